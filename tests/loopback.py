"""Flower's deployment on loopback, for the tests that start it (tests/test_flower_faults.py,
tests/test_flower_security.py): a SuperLink and SuperNodes started with Flower's own commands on
127.0.0.1 — insecure, or TLS with SuperNode authentication — and ``flwr run`` of fedlt's app.
Every process is started in a process group of its own, writes its log in the deployment's
folder and is stopped by its pid with every process below it; every wait is bounded; every port
is a free one picked at start (several test processes may deploy at once)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlt.flower.deploy import connection_toml, write_app

BIN = Path(sys.executable).parent
BOOT_S = 180.0  # bound on any wait for processes to start (imports under load)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, ready, limit: float, log: Path | None = None):
    """Poll ``ready()`` until it is truthy, at most ``limit`` seconds; else fail saying what."""
    deadline = time.monotonic() + limit
    while not (value := ready()):
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            pytest.fail(f"no {what} within {limit:.0f} s\n{tail}")
        time.sleep(0.2)
    return value


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, commands[child]))
            todo.append(child)
    return found


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """``sig`` to ``pid`` and every process below it (listed first: a dead parent's children
    would be reparented out of reach)."""
    for target in [pid, *(child for child, _ in descendants(pid))]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


class Deployment:
    """A SuperLink and SuperNodes on loopback, started and stopped by pid (with every process
    below them), each writing its log in ``root``. With ``keys`` (a folder holding ``ca.crt``,
    ``server.pem``, ``server.key`` and a private key per node), the SuperLink serves TLS and
    authenticates SuperNodes; else everything is insecure."""

    def __init__(self, root: Path, nodes: int = 2, keys: Path | None = None, federation: str = "loopback") -> None:
        self.root, self.num_nodes, self.keys, self.federation = root, nodes, keys, federation
        home = root / "home"
        home.mkdir()
        self.env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_HOME": str(home),
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONWARNINGS": "ignore",
                    "OMP_NUM_THREADS": "1"}  # one torch thread per process: the 2-core machine is shared
        self.port = free_port()
        ca = str(keys / "ca.crt") if keys else None
        (home / "config.toml").write_text(connection_toml(federation, f"127.0.0.1:{self.port}", ca))
        self.app = write_app(root / "app")
        self.started: list[subprocess.Popen] = []
        self.link: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        """Start Flower's command ``argv`` in a process group of its own, its log ``<name>.log``."""
        log = self.root / f"{name}.log"
        with open(log, "a") as out:
            proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        self.logs[name] = log
        return proc

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if self.logs[name].exists() else ""

    def start_link(self) -> None:
        security = (["--ssl-ca-certfile", str(self.keys / "ca.crt"), "--ssl-certfile", str(self.keys / "server.pem"),
                     "--ssl-keyfile", str(self.keys / "server.key"), "--enable-supernode-auth"]
                    if self.keys else ["--insecure"])
        self.link = self.start("superlink", "flower-superlink", *security, "--disable-runtime-dependency-installation",
                               "--host", "127.0.0.1", "--port", str(self.port))
        wait_for("SuperLink listening", lambda: listening(self.port), BOOT_S, self.logs["superlink"])

    def start_node(self, partition: int, *security: str, name: str | None = None) -> subprocess.Popen:
        """A SuperNode for ``partition``: insecure, or (with keys) TLS authenticated with the key
        ``node<partition>``; ``security`` replaces those arguments (a node that must not get in)."""
        if not security:
            security = (("--root-certificates", str(self.keys / "ca.crt"), "--auth-supernode-private-key",
                         str(self.keys / f"node{partition}")) if self.keys else ("--insecure",))
        proc = self.start(name or f"supernode{partition}", "flower-supernode", "--superlink", f"127.0.0.1:{self.port}",
                          *security, "--node-config", f"partition-id={partition} num-partitions={self.num_nodes}",
                          "--host", "127.0.0.1", "--port", str(free_port()))
        if name is None:
            self.nodes[partition] = proc
        return proc

    def signal_node(self, partition: int, sig: signal.Signals) -> None:
        """Signal the node's whole process tree (SuperNode, its SuperExec, a ClientApp under way):
        the machine dies (SIGKILL) or freezes (SIGSTOP)."""
        signal_tree(self.nodes[partition].pid, sig)
        if sig == signal.SIGKILL:
            self.nodes[partition].wait(timeout=30)

    def kill_link(self) -> None:
        """SIGKILL the SuperLink machine: SuperLink, its SuperExec, the ServerApps; its port is
        free once the SuperLink is reaped."""
        signal_tree(self.link.pid, signal.SIGKILL)
        self.link.wait(timeout=30)

    def tasks_received(self, partition: int) -> int:
        """Task messages the node has taken in (its log), whatever its process since a restart."""
        return self._count(partition, "Receiving: train")

    def replies_sent(self, partition: int) -> int:
        """Replies to task messages the node has sent (its log), whatever its process since a restart."""
        return self._count(partition, "Sending: train")

    def _count(self, partition: int, words: str) -> int:
        log = self.logs.get(f"supernode{partition}")
        return log.read_text().count(words) if log and log.exists() else 0

    def flwr_run(self, name: str, config: Path, resume: bool = False) -> subprocess.Popen:
        settings = f'config="{config}" node-wait=120' + (" resume=true" if resume else "")
        return self.start(name, "flwr", "run", str(self.app), self.federation, "--stream", "--run-config", settings)

    def server_app_pids(self) -> list[int]:
        """The ``flwr-serverapp`` processes holding the runs: in Flower 1.41 the SuperLink starts a
        ``flower-superexec`` (its own process group) that starts one ``flwr-serverapp`` per run."""
        return [pid for pid, command in descendants(self.link.pid) if "flwr-serverapp" in command]

    def stop(self) -> None:
        """SIGKILL every process this deployment started and all their descendants (Flower's
        SuperExec puts its children in process groups of their own), by pid."""
        for proc in self.started:
            if proc.poll() is None:
                signal_tree(proc.pid, signal.SIGKILL)
        for proc in self.started:
            proc.wait(timeout=30)

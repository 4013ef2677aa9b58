"""A real deployment on loopback, secured (docs/flower.md, "Deployment: SuperLink and SuperNodes"): a
SuperLink serving TLS with certificates made here by a throwaway CA, and SuperNode authentication
(Flower's node keys, registered with ``flwr supernode register``). A SuperNode whose key was never
registered is refused, one that trusts another CA cannot connect, one without TLS cannot either; the
two registered nodes complete one round of FedAvg through ``flwr run`` — the run directory complete,
the metrics row sane — that ends where the local engine ends; ``flwr run`` against a SuperLink nobody
serves is a clear error in bounded time. The insecure deployment (``--insecure``, the same SuperLink,
SuperNodes, app and ``flwr run``) is started by tests/test_flower_faults.py, whose SCALA run loses
nodes and its SuperLink and ends where the local engine ends. TLS and authentication wrap every
message alike, whatever it carries, so each kind of algorithm crosses a deployment once in the suite:
FedAvg (one message a client a round) here, SCALA's exchange (T + 1 messages a round) there. Every process
is started on 127.0.0.1 (tests/loopback.py) and stopped by its pid with everything below it; every
wait is bounded."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
from cryptography import x509  # noqa: E402  (a dependency of flwr)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from fedlt import io  # noqa: E402
from fedlt.config import RunConfig  # noqa: E402
from fedlt.engine import run  # noqa: E402
from fedlt.flower.deploy import connection_toml, write_app  # noqa: E402
from fedlt.testing.engines import differences  # noqa: E402
from loopback import BIN, Deployment, free_port  # noqa: E402  (tests/loopback.py)

ROUND = {"clients": 2, "participation": 1.0, "rounds": 1, "train_limit": 200, "test_limit": 50, "server_batch": 16,
         "local_iters": 1, "eval_every": 1, "partition": {"name": "dirichlet", "beta": 0.5, "min_size": 5}}
FEDAVG = {"algorithm": "fedavg", "model": "mlp"}
NODES = ("node0", "node1")
pytestmark = pytest.mark.xdist_group("loopback")  # one deployment at a time (tests/conftest.py)


# -- certificates and node keys, made here --------------------------------------------------------------
def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey,
                 *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:  # the server's name as the SuperNodes dial it
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_credentials(where: Path) -> None:
    """``ca.crt``; ``server.pem`` / ``server.key`` signed by it; ``other-ca.crt`` (a CA that signed
    nothing here); an OpenSSH EC key pair per node and one for a ``stranger`` never registered."""
    pem = serialization.Encoding.PEM
    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    (where / "ca.crt").write_bytes(
        _certificate("fedlt test CA", ca_key, "fedlt test CA", ca_key, ca=True).public_bytes(pem))
    (where / "other-ca.crt").write_bytes(
        _certificate("another CA", other_key, "another CA", other_key, ca=True).public_bytes(pem))
    (where / "server.pem").write_bytes(
        _certificate("127.0.0.1", server_key, "fedlt test CA", ca_key, ca=False).public_bytes(pem))
    (where / "server.key").write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                serialization.NoEncryption()))
    for node in (*NODES, "stranger"):  # Flower's node keys: EC on a NIST curve, OpenSSH format
        key = ec.generate_private_key(ec.SECP384R1())
        (where / node).write_bytes(key.private_bytes(pem, serialization.PrivateFormat.OpenSSH,
                                                     serialization.NoEncryption()))
        (where / f"{node}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                          serialization.PublicFormat.OpenSSH))


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A TLS SuperLink with SuperNode authentication, the two node keys registered, a SuperNode
    per key running (TLS, authenticated)."""
    root = tmp_path_factory.mktemp("secure")
    keys = root / "keys"
    keys.mkdir()
    make_credentials(keys)
    deployment = Deployment(root, nodes=len(NODES), keys=keys, federation="lab")
    try:
        deployment.start_link()
        registrations = [deployment.start(f"register-{node}", "flwr", "supernode", "register",
                                          str(keys / f"{node}.pub"), "lab", "--format", "json") for node in NODES]
        for node, proc in zip(NODES, registrations):
            assert proc.wait(timeout=120) == 0, deployment.log(f"register-{node}")[-2000:]
            assert json.loads(deployment.log(f"register-{node}"))["success"] is True
        for k in range(len(NODES)):
            deployment.start_node(k)
        yield deployment
    finally:
        deployment.stop()


# What a SuperNode that must not get in is started with, and the words its refusal is logged with.
INTRUDERS = {
    "unknown key": (["--root-certificates", "ca.crt", "--auth-supernode-private-key", "stranger"],
                    "Failed to activate SuperNode"),
    "wrong CA": (["--root-certificates", "other-ca.crt", "--auth-supernode-private-key", "node0"],
                 "CERTIFICATE_VERIFY_FAILED"),
    "no TLS": (["--insecure"], "could not establish a connection"),  # (Flower refuses a key without TLS itself)
}


def test_a_node_with_an_unknown_key_the_wrong_ca_or_no_tls_is_refused(secure):
    started = {}
    for case, (args, _) in INTRUDERS.items():  # all at once: each waits out Flower's bounded retries
        args = [str(secure.keys / a) if (secure.keys / a).is_file() else a for a in args]
        # --isolation process: no SuperExec below it (a refused node has no task to run; its
        # SuperExec's start, cut short by the refusal, held the node's exit up for ~15 s)
        started[case] = secure.start_node(0, *args, "--max-retries", "1", "--max-wait-time", "20",
                                          "--isolation", "process", name=f"intruder-{case.replace(' ', '-')}")
    for case, proc in started.items():
        code = proc.wait(timeout=120)
        log = secure.log(f"intruder-{case.replace(' ', '-')}")
        assert code != 0 and INTRUDERS[case][1] in log, f"{case}: exit {code}\n{log[-2000:]}"
    assert "No SuperNode found with the given public key" in secure.log("superlink")


def test_an_authenticated_tls_federation_ends_where_the_local_engine_ends(secure):
    root, config = secure.root, {**ROUND, **FEDAVG}
    deployed, local = root / "deployed", RunConfig(**config, out=root / "local")
    (root / "run.json").write_text(json.dumps({**config, "out": str(deployed)}))
    proc = secure.flwr_run("run", root / "run.json")
    run(local)  # while the deployment works
    assert proc.wait(timeout=600) == 0, secure.log("run")[-3000:]
    assert sorted(p.name for p in deployed.iterdir()) == ["checkpoint.json", "checkpoint.pt", "config.json",
                                                          "metrics.jsonl", "partition.json", "partition.npz",
                                                          "summary.json"]
    assert json.loads((deployed / "summary.json").read_text())["rounds"] == 1
    ends = [io.load_checkpoint(d / "checkpoint.pt") for d in (Path(local.out), deployed)]
    for part in ("algorithm", "client_states"):
        found = differences(ends[0][part], ends[1][part], 1e-6)  # the engine contract's tolerance
        assert not found, f"{part} differs between local and the deployment: {found[:3]}"
    rows = [json.loads(line) for line in (deployed / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] and rows[0]["participants"] == 2
    assert 0.0 <= rows[0]["accuracy"] <= 1.0 and rows[0]["train_loss"] > 0


def test_an_unreachable_superlink_is_a_clear_error_in_bounded_time(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(connection_toml("nowhere", f"127.0.0.1:{free_port()}"))  # nothing listens
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_HOME": str(home)}
    started = time.monotonic()
    proc = subprocess.run([str(BIN / "flwr"), "run", str(write_app(tmp_path / "app")), "nowhere"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "SuperLink is unavailable" in proc.stdout + proc.stderr
    assert time.monotonic() - started < 120

"""The ServerApp: fedlt's own run loop (fedlt.engine.run) with each round's client work sent
as Flower messages through the Grid. The algorithm's round logic is not repeated here: the loop
calls ``algorithm.train_round(..., runner)`` with ``FlowerRounds`` as the runner, and the
algorithm asks it for one-call work (``call``: one ``train`` message per participant) or for
sessions (``exchange``: ``train.step`` messages), whatever its class.

Deployed (``flwr run``), the app reads its run from the run config: ``config`` (a fedlt config
file on the server machine, TOML / YAML / JSON, as ``fedlt run --config``), optional ``resume``
(true: continue the run in the config's ``out``) and ``node-wait`` (seconds to wait for the
SuperNodes to connect, default 120).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedlt.algorithms.protocol import ClientResult, ClientTask, Upload
from fedlt.config import RunConfig
from fedlt.errors import FedltError
from fedlt.flower import codec

NODE_WAIT_S = 120.0  # how long to wait for the SuperNodes to connect
REPLY_WAIT_S = 3600.0  # how long one exchange may take (a round's local training, at most)


class FlowerRounds:
    """A ClientRunner (fedlt.algorithms.protocol) that sends a round's tasks to the nodes holding
    the participants' partitions and collects the replies."""

    def __init__(self, grid: Grid, config: RunConfig, node_wait: float = NODE_WAIT_S,
                 reply_wait: float = REPLY_WAIT_S) -> None:
        self.grid, self.config, self.node_wait, self.reply_wait = grid, config, node_wait, reply_wait
        self.device = torch.device(config.device)
        self.run = ConfigRecord({"config": config.model_dump_json(),
                                 "partition": str(Path(config.out).resolve() / "partition.npz")})
        self._nodes: dict[int, int] | None = None  # cid -> node id
        self.round_index = 0
        self.exchanges = 0  # round trips made (one message per participant each)
        self.exchange_s: list[float] = []  # wall time of each, send to last reply (benchmarks read it)

    # -- the runner ------------------------------------------------------------------------------
    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult]:
        self.round_index = tasks[0].round_index if tasks else self.round_index
        contents = []
        for t in tasks:
            content = codec.task_content(t)
            content["client"] = ConfigRecord({"cid": t.cid})
            contents.append((t.cid, content))
        return [codec.value(r, self.device) for r in self.send("train", contents)]

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> "FlowerSessions":
        self.round_index = tasks[0].round_index if tasks else self.round_index
        return FlowerSessions(self, list(tasks))

    # -- messages --------------------------------------------------------------------------------
    def nodes(self) -> dict[int, int]:
        """Which node holds which partition: asked once, after waiting (bounded) for the nodes."""
        if self._nodes is None:
            deadline = time.monotonic() + self.node_wait
            ids = list(self.grid.get_node_ids())
            while len(ids) < self.config.clients and time.monotonic() < deadline:
                time.sleep(0.5)
                ids = list(self.grid.get_node_ids())
            asked = [Message(RecordDict(), node, "query.partition") for node in ids]
            replies = self._deliver(asked, "asking the SuperNodes for their partitions")
            self._nodes = {int(r.content["node"]["partition_id"]): r.metadata.src_node_id for r in replies}
            missing = sorted(set(range(self.config.clients)) - set(self._nodes))
            if missing:
                raise FedltError(f"no SuperNode holds partition(s) {missing[:10]} of {self.config.clients} after "
                                 f"{self.node_wait:.0f}s ({len(ids)} node(s) connected); start one per client with "
                                 "--node-config 'partition-id=K'")
        return self._nodes

    def send(self, message_type: str, contents: list[tuple[int, RecordDict]]) -> list[RecordDict]:
        """One message per participant, the replies' contents in the same order."""
        nodes = self.nodes()
        started = time.perf_counter()
        messages = []
        for cid, content in contents:
            content["run"] = self.run
            messages.append(Message(content, nodes[cid], message_type, group_id=str(self.round_index)))
        by_node = {r.metadata.src_node_id: r for r in self._deliver(messages, f"round {self.round_index + 1}")}
        self.exchanges += 1
        self.exchange_s.append(time.perf_counter() - started)
        return [by_node[nodes[cid]].content for cid, _ in contents]

    def _deliver(self, messages: list[Message], what: str) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=self.reply_wait))
        for reply in replies:
            if reply.has_error():
                raise FedltError(f"{what}: node {reply.metadata.src_node_id} failed: {reply.error.reason}")
        if len(replies) < len(messages):
            raise FedltError(f"{what}: {len(messages) - len(replies)} of {len(messages)} node(s) did not reply "
                             f"within {self.reply_wait:.0f}s")
        return replies


class FlowerSessions:
    """The round's split-learning sessions on their nodes. ``backward`` sends nothing by itself:
    the gradients ride on the next ``forward`` (or ``finish``) message, so a round of T local
    iterations is T + 1 round trips per participant instead of 2T + 1."""

    def __init__(self, rounds: FlowerRounds, tasks: list[ClientTask]) -> None:
        self.rounds, self.tasks = rounds, tasks
        self.opened = False
        self.grads: list[torch.Tensor | None] = [None] * len(tasks)

    def _contents(self, finish: bool) -> list[tuple[int, RecordDict]]:
        contents = []
        for task, grad in zip(self.tasks, self.grads):
            if self.opened:
                content = RecordDict({f"grad.{k}": r for k, r in codec.records(grad, "activation gradient").items()})
            else:
                content = codec.task_content(task)
                content["client"] = ConfigRecord({"cid": task.cid})
            content["step"] = ConfigRecord({"finish": finish})
            contents.append((task.cid, content))
        self.opened, self.grads = True, [None] * len(self.tasks)
        return contents

    def forward(self) -> list[Upload]:
        replies = self.rounds.send("train.step", self._contents(finish=False))
        return [codec.value(r, self.rounds.device) for r in replies]

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        self.grads = list(grads)

    def finish(self) -> list[ClientResult]:
        replies = self.rounds.send("train.step", self._contents(finish=True))
        return [codec.value(r, self.rounds.device) for r in replies]


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """A deployed run: the fedlt config file named by the run config, driven through ``grid``."""
    from fedlt.config import read_config_file
    from fedlt.engine import run

    settings = context.run_config
    if "config" not in settings:
        raise FedltError("the ServerApp needs a fedlt config file: flwr run ... --run-config 'config=\"run.toml\"'")
    config = RunConfig.model_validate(read_config_file(Path(str(settings["config"]))))
    rounds = FlowerRounds(grid, config, node_wait=float(settings.get("node-wait", NODE_WAIT_S)))
    summary = run(config, resume=bool(settings.get("resume", False)), runner=rounds)
    print(f"fedlt: final accuracy {summary['final']['accuracy']:.4f} after {summary['rounds']} rounds -> {config.out}",
          flush=True)

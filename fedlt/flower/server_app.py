"""The ServerApp: fedlt's own run loop (fedlt.run.loop.run) with each round's client work sent
as Flower messages through the Grid. The algorithm's round logic is not repeated here: the loop
calls ``algorithm.train_round(..., runner)`` with ``FlowerRunner`` as the runner, and the
algorithm asks it for one-call work (``call``: one ``train`` message per participant) or for
sessions (``exchange``: ``train.step`` messages), whatever its class; the loop's per-client
evaluation (``evaluate``) is Flower's federated evaluation: one ``evaluate`` message per client.

Deployed (``flwr run``), the app reads its run from the run config: ``config`` (a fedlt config
file on the server machine, TOML / YAML / JSON, as ``fedlt run --config``), optional ``resume``
(true: continue the run in the config's ``out``) and ``node-wait`` (seconds to wait for the
SuperNodes to connect, default 120).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedlt.algorithms.protocol import ClientFailure, ClientResult, ClientTask, RoundSessions, Runner, Upload
from fedlt.config import RunConfig, read_config_file
from fedlt.errors import FedltError
from fedlt.flower import codec, error_line, secaggplus
from fedlt.run import loop

NODE_WAIT_S = 120.0  # how long to wait for the SuperNodes to connect
REPLY_WAIT_S = 3600.0  # how long one exchange may take (a round's local training, at most)
# polling for replies backs off from FIRST_POLL_S to ``poll_cap``: light on a SuperLink (a second);
# in simulation the grid is in memory and a reply comes in milliseconds, so a second-long pause
# (or the 0.5 s one the node query had) was most of a small round's time (simulate passes 0.05 s)
FIRST_POLL_S, POLL_CAP_S = 0.01, 1.0


# the Flower message type of each kind of one-call work (fedlt.algorithms.protocol.CLIENT_CALLS);
# the ClientApp answers each with that work
MESSAGE_TYPES = {"work": "train", "evaluate": "evaluate"}  # per-client evaluation: federated evaluation


class FlowerRunner(Runner):
    """A ClientRunner (fedlt.algorithms.protocol) that sends a round's tasks to the nodes holding
    the participants' partitions and collects the replies. A lost node's client is dropped, not
    fatal, under ``faults.on_failure="drop"`` (``tolerate``)."""

    def __init__(self, grid: Grid, config: RunConfig, node_wait: float = NODE_WAIT_S,
                 reply_wait: float | None = None, poll_cap: float = POLL_CAP_S) -> None:
        super().__init__(tolerate=config.faults.on_failure == "drop")
        # the round policy's deadline is the wait for replies too (docs/faults.md)
        reply_wait = reply_wait or config.faults.round_timeout or REPLY_WAIT_S
        self.grid, self.config, self.node_wait, self.reply_wait = grid, config, node_wait, reply_wait
        self.poll_cap = poll_cap
        self.device = torch.device(config.device)
        self.run = ConfigRecord({"config": config.model_dump_json(),
                                 "partition": str(Path(config.out).resolve() / "partition.npz")})
        self._nodes: dict[int, int] = {}  # cid -> node id
        self._asked: set[int] = set()  # nodes asked which partition they hold
        self._queries: dict[str, int] = {}  # query message id -> node, not answered yet
        self.round_index = 0
        self.exchanges = 0  # round trips made (one message per participant each)
        self.exchange_s: list[float] = []  # wall time of each, send to last reply (benchmarks read it)

    # -- the runner ------------------------------------------------------------------------------
    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]:
        """The round's one-call training: under secure aggregation (the tasks' upload plan) through
        Flower's SecAgg+ (fedlt.flower.secaggplus), else one ``train`` message per participant."""
        if tasks and tasks[0].upload is not None and tasks[0].upload.secure:
            self.round_index = tasks[0].round_index
            return secaggplus.secure_round(self, tasks)
        return self.each("work", algorithm, tasks)

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        self.round_index = tasks[0].round_index if tasks else self.round_index
        self.nodes()
        contents = []
        for t in tasks:
            content = codec.task_content(t)
            content["client"] = ConfigRecord({"cid": t.cid})
            contents.append((t.cid, content))
        replies = self.send(MESSAGE_TYPES[job], contents)
        return [r if isinstance(r, ClientFailure) else codec.value(r, self.device) for r in replies]

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> "FlowerSessions":
        if tasks and tasks[0].upload is not None and tasks[0].upload.secure:  # RunConfig refuses it first
            raise FedltError("secure aggregation: split-learning sessions cannot go through Flower's SecAgg+")
        self.round_index = tasks[0].round_index if tasks else self.round_index
        self.nodes()
        return FlowerSessions(self, list(tasks))

    # -- messages --------------------------------------------------------------------------------
    def nodes(self) -> dict[int, int]:
        """Which node holds which partition, brought up to date at each round's start: every node
        not asked before is asked (a restarted SuperNode has a new id). The first time, the answers
        are awaited until every partition has a node (at most ``node_wait``); later, only the new
        nodes' answers (at most ``reply_wait``; a later answer is taken at a later round). A node that
        stops answering keeps its partition until another node claims it, so a stalled node that
        resumes serves again, and a dead one that is still listed costs no wait here."""
        first = not self._asked
        everyone = self.config.partition_clients  # the new clients' nodes too: they are evaluated there
        deadline = time.monotonic() + (self.node_wait if first else self.reply_wait)
        waiting: set[str] = set()  # this call's queries
        refused: dict[int, str] = {}  # node -> its error, the first time
        pauses = self._pauses()
        while True:
            new = [node for node in self.grid.get_node_ids() if node not in self._asked]
            if new:
                self._asked.update(new)
                ids = list(self.grid.push_messages([Message(RecordDict(), node, "query.partition") for node in new]))
                self._queries.update(zip(ids, new))
                waiting.update(ids)
            for reply in (self.grid.pull_messages(list(self._queries)) if self._queries else []):
                asked = reply.metadata.reply_to_message_id
                node = self._queries.pop(asked, None)
                waiting.discard(asked)
                if not reply.has_error():
                    self._nodes[int(reply.content["node"]["partition_id"])] = reply.metadata.src_node_id
                elif first:
                    refused[node] = error_line(str(reply.error.reason))
                    if not self.tolerate:  # under drop, another node may yet claim its partition
                        raise FedltError(f"asking the SuperNodes for their partitions: node {node} failed: "
                                         f"{refused[node]}")
            complete = len(self._nodes.keys() & set(range(everyone))) == everyone
            if (complete if first else not waiting) or time.monotonic() >= deadline:
                break
            time.sleep(min(next(pauses), max(deadline - time.monotonic(), 0.0)))
        missing = sorted(set(range(everyone)) - set(self._nodes))
        if missing and first:
            raise FedltError(f"no SuperNode holds partition(s) {missing[:10]} of {everyone} after "
                             f"{self.node_wait:.0f}s ({len(self._asked)} node(s) connected); start one per client with "
                             "--node-config 'partition-id=K'"
                             + "".join(f"; node {node} answered: {reason}" for node, reason in refused.items()))
        return self._nodes

    def send(self, message_type: str, contents: list[tuple[int, RecordDict]]) -> list[RecordDict | ClientFailure]:
        """One message per participant, the replies' contents in the same order; a participant
        whose node is gone, failed or did not reply in time is a ClientFailure when failures are
        tolerated, else an error."""
        nodes = self._nodes
        started = time.perf_counter()
        messages, out = [], {}
        for cid, content in contents:
            if cid not in nodes:
                out[cid] = ClientFailure(cid, "unavailable (no SuperNode holds its partition)")
                continue
            content["run"] = self.run
            messages.append(Message(content, nodes[cid], message_type, group_id=str(self.round_index)))
        replies = iter(self._deliver(messages, f"round {self.round_index + 1}"))
        for cid, _ in contents:
            if cid in out:
                continue
            reply = next(replies)
            if reply is None:
                out[cid] = ClientFailure(cid, f"late (no reply within {self.reply_wait:g} s)")
            elif reply.has_error():
                out[cid] = ClientFailure(cid, f"failed: {error_line(str(reply.error.reason))}")
            else:
                out[cid] = reply.content
        self.exchanges += 1
        self.exchange_s.append(time.perf_counter() - started)
        return [out[cid] for cid, _ in contents]

    def _deliver(self, messages: list[Message], what: str) -> list[Message | None]:
        """Send, and wait for the replies at most ``reply_wait``: each message's reply (a node's
        answer, or the SuperLink's error for a node it declared unavailable: an error from
        the SuperLink, not from the node), None for no reply in time. Unless failures are
        tolerated, an error reply or a missing one is an error naming the node."""
        if not messages:
            return []
        ids = list(self.grid.push_messages(messages))
        replies: dict[str, Message] = {}
        deadline, pauses = time.monotonic() + self.reply_wait, self._pauses()
        while len(replies) < len(ids) and time.monotonic() < deadline:
            time.sleep(min(next(pauses), max(deadline - time.monotonic(), 0.0)))
            for reply in self.grid.pull_messages([i for i in ids if i not in replies]):
                replies[reply.metadata.reply_to_message_id] = reply
        ordered = [replies.get(i) for i in ids]
        if not self.tolerate:
            for message, reply in zip(messages, ordered):
                if reply is None:
                    raise FedltError(f"{what}: node {message.metadata.dst_node_id} did not reply within "
                                     f"{self.reply_wait:.0f}s")
                if reply.has_error():
                    raise FedltError(f"{what}: node {message.metadata.dst_node_id} failed: {reply.error.reason}")
        return ordered


    def _pauses(self) -> Iterator[float]:
        """The waits between two polls of the grid: doubling from FIRST_POLL_S up to ``poll_cap``."""
        pause = FIRST_POLL_S
        while True:
            yield pause
            pause = min(2 * pause, self.poll_cap)


class FlowerSessions(RoundSessions):
    """The round's split-learning sessions on their nodes. ``backward`` sends nothing by itself:
    the gradients ride on the next ``forward`` (or ``finish``) message, so a round of T local
    iterations is T + 1 round trips per participant instead of 2T + 1. A participant that left
    (``drop``, or lost: a ClientFailure, reported once) gets no more messages (RoundSessions)."""

    def __init__(self, runner: FlowerRunner, tasks: list[ClientTask]) -> None:
        super().__init__(tasks)
        self.runner = runner
        self.opened = False
        self.grads: list[torch.Tensor | None] = [None] * len(tasks)

    def _exchange(self, finish: bool) -> list:
        live = self.live()
        contents = []
        for k in live:
            task, grad = self.tasks[k], self.grads[k]
            if self.opened:
                content = RecordDict({f"grad.{key}": r for key, r in codec.records(grad, "activation gradient").items()})
            else:
                content = codec.task_content(task)
                content["client"] = ConfigRecord({"cid": task.cid})
            content["step"] = ConfigRecord({"finish": finish})
            contents.append((task.cid, content))
        self.opened, self.grads = True, [None] * len(self.tasks)
        values: dict[int, Any] = {}
        for k, reply in zip(live, self.runner.send("train.step", contents) if contents else []):
            if isinstance(reply, ClientFailure):
                self.fail(k, reply.reason)
            else:
                values[k] = codec.value(reply, self.runner.device)
        return self.report(values)

    def forward(self) -> list[Upload | ClientFailure | None]:
        return self._exchange(finish=False)

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        self.grads = list(grads)

    def finish(self) -> list[ClientResult | ClientFailure | None]:
        return self._exchange(finish=True)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """A deployed run: the fedlt config file named by the run config, driven through ``grid``."""
    settings = context.run_config
    if "config" not in settings:
        raise FedltError("the ServerApp needs a fedlt config file: flwr run ... --run-config 'config=\"run.toml\"'")
    config = RunConfig.model_validate(read_config_file(Path(str(settings["config"]))))
    runner = FlowerRunner(grid, config, node_wait=float(settings.get("node-wait", NODE_WAIT_S)))
    summary = loop.run(config, resume=bool(settings.get("resume", False)), runner=runner)
    print(f"fedlt: final accuracy {summary['final']['accuracy']:.4f} after {summary['rounds']} rounds "
          f"({summary['rounds_trained']} trained, {summary['rounds_skipped']} skipped) -> {config.out}", flush=True)
    for warning in summary.get("warnings", []):
        print(f"fedlt: warning: {warning}", flush=True)

"""The ClientApp: one fedlt client per SuperNode (docs/flower.md).

A node serves the partition ``partition-id`` of its node config (Flower's simulation assigns
0..N-1; a real SuperNode is started with ``--node-config "partition-id=3"``). Message types (the
server side chose one by what the algorithm asked its runner for, never by the algorithm's class):
- ``query.partition``: which partition this node holds.
- ``train``: one-call client work (the algorithm's ``client_work`` on the received task). Under
  secure aggregation the round's training is Flower's SecAgg+ workflow instead: ``train``
  messages carrying its record go through Flower's ``secaggplus_mod``, which answers three of its
  four stages itself and, in the fourth, masks what ``client_work.secaggplus_work`` returns
  (fedlt.flower.secaggplus).
- ``train.step``: one exchange of a split-learning session (the algorithm's ``open_session``).
  The first carries the task and returns the first upload; each next one carries the activation
  gradient of the previous upload (the session's ``backward``) and returns the next upload
  (``forward``), or, when ``finish`` is set, the result (``finish``). Between messages the
  session — the replica's weights, its optimiser's momentum, how far its batch stream and its
  random stream have gone — is kept in the node's ``context.state``, never sent.
- ``evaluate``: federated evaluation (issue 32): an EvalTask without data; the node slices its
  client's test set (``client_test``) and training data from its own parts and answers with the
  ClientScores (fedlt.algorithms.personal.evaluate_client).

On a SuperNode every message is a ``flwr-clientapp`` process of its own that imports this module.
The partition query needs nothing but the node config, so the client work (torch, the run's
parts: ``fedlt.flower.client_work``) is imported by the first message that trains or evaluates:
the query is answered in about a second instead of after a torch and fedlt start (~5 s of CPU;
3 to 4 times that on a busy machine), and every run asks each node once.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS as SECAGGPLUS_RECORD

app = ClientApp()


def work() -> ModuleType:
    """``fedlt.flower.client_work``, imported on first use (see the module docstring)."""
    from fedlt.flower import client_work

    return client_work


@app.query("partition")
def partition(message: Message, context: Context) -> Message:
    return Message(RecordDict({"node": ConfigRecord({"partition_id": int(context.node_config["partition-id"])})}),
                   reply_to=message)


def secure_aggregation(message: Message, context: Context, call_next: Any) -> Message:
    """Flower's SecAgg+ mod (``flwr.client.mod.secaggplus_mod``) around the train messages of its
    workflow (those carrying its record: fedlt.flower.secaggplus); fedlt's own pass by."""
    if SECAGGPLUS_RECORD not in message.content.config_records:
        return call_next(message, context)
    from flwr.client.mod import secaggplus_mod

    return secaggplus_mod(message, context, call_next)


@app.train(mods=[secure_aggregation])
def train(message: Message, context: Context) -> Message:
    if "fitins.config" in message.content.config_records:  # SecAgg+'s collect stage: a legacy FitIns
        return work().secaggplus_work(message, context)
    return work().one_call("work", message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return work().one_call("evaluate", message, context)


@app.train("step")
def step(message: Message, context: Context) -> Message:
    return work().step(message, context)

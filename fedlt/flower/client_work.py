"""A node's client work for the ClientApp (``fedlt.flower.client_app``, which loads this module on
the first message that needs it): the run's parts, built from the configuration sent with every
message (~1 kB) and cached for the life of the process, the one-call work (``train``,
``evaluate``) and the split-learning steps (``train.step``).

A node serves the partition ``partition-id`` of its node config, read from ``partition-file`` in
its node config, else from the path the ServerApp sends (the run directory's ``partition.npz``:
the same file when server and nodes share a disk). Every client runs in its own random stream
(``fedlt.algorithms.protocol``), as on the local engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.protocol import CLIENT_CALLS, SeededSession
from fedlt.errors import FedltError
from fedlt.flower import codec, secaggplus
from fedlt.run import parts

_PREPARED: dict[tuple[str, str], Any] = {}  # (config, partition file) -> the run's parts; a cache, no state


def prepared(run: ConfigRecord, context: Context):
    """The run's dataset, partition and algorithm (built as the server built them: same seeds)."""
    path = str(context.node_config.get("partition-file", run["partition"]))
    key = (str(run["config"]), path)
    if key not in _PREPARED:
        prep = parts.rebuild(str(run["config"]), Path(path))
        _PREPARED.clear()  # one run at a time per process
        _PREPARED[key] = prep
    return _PREPARED[key]


def client_data(prep, cid: int, context: Context) -> ClientData:
    held = int(context.node_config.get("partition-id", -1))
    if cid != held:
        raise FedltError(f"a task for client {cid} reached the node holding partition {held}")
    return parts.client_data(prep, cid, torch.device(prep.config.device))


def one_call(job: str, message: Message, context: Context) -> Message:
    """One-call work of kind ``job`` (fedlt.algorithms.protocol.CLIENT_CALLS) on the received task;
    the server side's ``FlowerRunner.each`` sends it as the message type ``MESSAGE_TYPES[job]``."""
    content = message.content
    prep = prepared(content["run"], context)
    task = parts.with_held(prep, codec.value(content, prep.config.device), client_data(prep, _cid(content), context))
    result = CLIENT_CALLS[job](prep.algorithm, task)
    return Message(codec.content(result, f"result of client {task.cid}"), reply_to=message)


def secaggplus_work(message: Message, context: Context) -> Message:
    """SecAgg+'s collect stage (fedlt.flower.secaggplus): the task in the FitIns trained, and a
    FitRes whose parameters are the client's dense update [Δ, b] and num_examples its weight —
    what Flower's ``secaggplus_mod`` quantises and masks on its way out — and whose metrics hold
    the rest of the result. The update must lie within the round's clipping range once weighted."""
    config = compat.recorddict_to_fitins(message.content, keep_input=True).config
    prep = prepared(ConfigRecord({"config": config["fedlt.config"], "partition": config["fedlt.partition"]}), context)
    cid = int(config["fedlt.cid"])
    task = parts.with_held(prep, codec.from_scalars(config, prep.config.device), client_data(prep, cid, context))
    result = CLIENT_CALLS["work"](prep.algorithm, task)
    update, weight = result.packed["dense"].numpy(), float(result.packed["weight"])
    ratio, reach = weight / float(config["fedlt.max_weight"]), float(config["fedlt.clipping_range"])
    biggest = float(np.abs(update).max()) * ratio if update.size else 0.0
    if ratio > 1.0 or biggest > reach:
        raise FedltError(f"secure aggregation: client {cid}'s weighted update reaches {biggest:.3g}, outside Flower's "
                         f"SecAgg+ clipping range ±{reach:g} (clip the update: --privacy 'client_level(clip=...)')")
    rest = dataclasses.replace(result, packed={"keys": result.packed["keys"]})
    np.random.seed(secaggplus.rounding_seed(task.context.sampling_seed, task.round_index, cid))  # the mod's rounding
    fit_res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([update]), int(weight),
                     codec.scalars(rest, f"result of client {cid}"))
    return Message(compat.fitres_to_recorddict(fit_res, keep_input=True), reply_to=message)


def _cid(content: RecordDict) -> int:
    return int(content["client"]["cid"])


OPEN = ("arrays", "tree", "client")  # the records of the open task, kept on the node for the round
SESSION = ("session.arrays", "session.tree")


def step(message: Message, context: Context) -> Message:
    """One exchange of a split-learning session (``train.step``, fedlt.flower.client_app): open it
    from the task, or restore it from ``context.state`` and apply the received gradient; then the
    next upload, or the result when ``finish`` is set."""
    content, kept = message.content, context.state
    prep = prepared(content["run"], context)
    opening = "tree" in content
    if opening:
        for key in OPEN:
            kept[f"fedlt.{key}"] = content[key]
    elif "fedlt.tree" not in kept:
        raise FedltError("a split-learning step reached a node with no open session")
    opened = RecordDict({key: kept[f"fedlt.{key}"] for key in OPEN})
    device = prep.config.device
    task = codec.task_from(opened, client_data(prep, _cid(opened), context), device)
    session = SeededSession(prep.algorithm, task)
    if not opening:
        session.load_state_dict(codec.value(RecordDict({k.partition(".")[2]: kept[f"fedlt.{k}"] for k in SESSION}),
                                            device))
    order = content["step"]
    if not opening:
        grad = codec.value(RecordDict({"arrays": content["grad.arrays"], "tree": content["grad.tree"]}), device)
        session.backward(grad)
    if order["finish"]:
        for key in (*OPEN, *SESSION):
            del kept[f"fedlt.{key}"]
        return Message(codec.content(session.finish(), f"result of client {task.cid}"), reply_to=message)
    reply = codec.content(session.forward(), f"upload of client {task.cid}")
    for key, record in codec.records(session.state_dict(), f"session of client {task.cid}").items():
        kept[f"fedlt.session.{key}"] = record
    return Message(reply, reply_to=message)

"""A run: its parts (``prepare``, ``client_data``, ``rebuild``), the round loop (``run`` with a
runner), the evaluation, checkpoints and resume rules, and the signals that stop it.

Layer: above fedlt.config; below the transports (fedlt.parallel, fedlt.flower) and the doors
(fedlt.engine is the public face: ``fedlt.engine.run`` picks the engine by name). May import the
bottom layer, the components, the algorithms and fedlt.config.
"""

from fedlt.run.evaluation import POSTHOC_KEYS, Evaluator
from fedlt.run.loop import RoundLoop, check_model_finite, run, summarise
from fedlt.run.parts import (Prepared, check_split_point, client_data, group_classes, load_data, make_partition,
                             prepare, rebuild, round_seed, sample_clients, train_round)
from fedlt.run.resume import (CHECKPOINT_FORMAT, RESUMABLE_CHANGES, Checkpoints, RunState, config_changes,
                              config_digest, restore)
from fedlt.run.signals import RunStopped, StoppedAtOnce, stop_on_signal

__all__ = ["CHECKPOINT_FORMAT", "POSTHOC_KEYS", "RESUMABLE_CHANGES", "Checkpoints", "Evaluator", "Prepared",
           "RoundLoop", "RunState", "RunStopped", "StoppedAtOnce", "check_model_finite", "check_split_point",
           "client_data", "config_changes", "config_digest", "group_classes", "load_data", "make_partition",
           "prepare", "rebuild", "restore", "round_seed", "run", "sample_clients", "stop_on_signal", "summarise",
           "train_round"]

"""The public face for plugin authors: everything a third-party component builds on, importable
from one place (``from fedlt.plugin import ClientUpdate, effective_steps, ...``), so a plugin
never reaches into a module whose layout may change. docs/plugins.md lists these names; a test
keeps the list and this module equal. Owns nothing itself; imports the components' and the
algorithms' modules (a door: nothing in fedlt imports it).
"""

from fedlt.aggregators import Aggregator, State, weighted_average
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LossExpression, NonFiniteLoss, RunContext,
                                   build_aggregator)
from fedlt.algorithms.fedavg_family import ClientUpdate, FedAvgFamily, Federated, Strategy, trainable_names
from fedlt.algorithms.protocol import ClientResult, ClientRunner, ClientStates, ClientTask
from fedlt.algorithms.split_server import ServerSide
from fedlt.algorithms.stateful import effective_steps, features_of
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.losses import LossTerm
from fedlt.partitioners import Partitioner
from fedlt.transforms import Compressor, UpdateTransform

__all__ = [
    # errors
    "FedltError", "NonFiniteLoss",
    # components
    "LossTerm", "Partitioner", "Aggregator", "State", "weighted_average",
    # algorithms: what a round receives and returns
    "RunContext", "RoundContext", "ClientData", "ClientTask", "ClientResult", "ClientStates", "ClientRunner",
    # algorithms: the FedAvg family's parts and their helpers
    "Federated", "FedAvgFamily", "ClientUpdate", "Strategy", "trainable_names", "effective_steps", "features_of",
    "build_aggregator", "AggregatorSpec", "LossExpression",
    # split learning
    "ServerSide",
    # update transforms (what a client does to its upload: docs/transforms.md)
    "UpdateTransform", "Compressor",
]

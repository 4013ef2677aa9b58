"""Contract checks for every kind of component: what fedlt relies on, checked in one call.

A plugin author tests a component in one line, by its registered name or by the object itself::

    from fedlt.testing import check_loss_term
    def test_my_loss():
        check_loss_term("my_loss", gamma=2.0)

fedlt's own tests run the same checks over every registered built-in (parametrised over the
registries, so a new built-in is covered the moment it is registered). A broken property raises
:class:`ContractError` (an AssertionError, so pytest shows it as a failure) whose message starts
with the component and the name of the property, e.g.
``loss 'my_loss' breaks [finite on extreme logits]: value nan with logits ±1e4``.

| kind | contract |
|---|---|
| loss term | :func:`check_loss_term` |
| partitioner | :func:`check_partitioner` |
| client test set | :func:`check_client_test` |
| model / splitter | :func:`check_model`, :func:`check_splitter` |
| classifier head | :func:`check_head` |
| aggregator | :func:`check_aggregator` |
| dataset | :func:`check_dataset` |
| algorithm | :func:`check_algorithm` |
| algorithm, on every engine | :func:`check_engines` (needs the ``flower`` extra; :class:`EngineCheck`: several in one simulation) |
| algorithm, in worker processes | :func:`check_parallel` |
| server-side step | :func:`check_server_step` |
| algorithm, on a (pretend) device | :func:`check_device` |
| algorithm, trained in vmapped cohorts | :func:`check_cohort` |
| algorithm, its steps through torch.compile | :func:`check_compile` |
| algorithm, its whole steps captured as graphs | :func:`check_graphs` |
| update transform (uploads) | :func:`check_transform` |
"""

from fedlt.testing.base import ContractError
from fedlt.testing.losses import check_loss_term
from fedlt.testing.partitioners import check_partitioner
from fedlt.testing.client_tests import check_client_test
from fedlt.testing.models import check_model, check_splitter
from fedlt.testing.heads import check_head
from fedlt.testing.aggregators import check_aggregator
from fedlt.testing.datasets import check_dataset
from fedlt.testing.algorithms import check_algorithm
from fedlt.testing.engines import EngineCheck, check_engines
from fedlt.testing.parallel import check_parallel
from fedlt.testing.server_steps import check_server_step
from fedlt.testing.device import check_device
from fedlt.testing.cohort import check_cohort
from fedlt.testing.compiled import check_compile
from fedlt.testing.graphs import check_graphs
from fedlt.testing.transforms import check_transform

__all__ = ["ContractError", "check_loss_term", "check_partitioner", "check_client_test", "check_model", "check_splitter", "check_head",
           "check_aggregator", "check_dataset", "check_algorithm", "check_engines", "EngineCheck", "check_parallel",
           "check_server_step", "check_device", "check_cohort", "check_compile", "check_graphs", "check_transform"]

"""The ``fx`` splitter: the fallback for any model torch.fx can trace."""

from __future__ import annotations

from torch import nn

from fedlt.errors import FedltError
from fedlt.models.splitting.fx_plan import _FxPlan, _model_name, _reason


class FxSplitter:
    """Any model torch.fx can trace, cut after a module whose output is all the rest needs.

    Python control flow is fixed when the model is traced (at split time), so a forward that
    branches on ``self.training`` keeps the branch of the mode the model was in.
    """

    priority = 100

    def applies(self, model: nn.Module) -> bool:
        return True

    # Building a plan or its parts is fedlt's code on a graph it did not choose: an exception it
    # did not anticipate becomes a FedltError naming the model (and cut), the original chained.

    def cut_points(self, model: nn.Module) -> list[tuple[str, str]]:
        try:
            return [(cut.name, cut.module) for cut in _FxPlan(model).cuts]
        except FedltError:
            raise
        except Exception as exc:
            raise FedltError(f"cannot list the cut points of {_model_name(model)}: {_reason(exc)}") from exc

    def split(self, model: nn.Module, index: int) -> tuple[nn.Module, nn.Module]:
        where = str(index)
        try:
            plan = _FxPlan(model)
            cut = plan.cuts[index]
            where = f"{index} ({cut.name})"
            return plan.parts(cut)
        except FedltError:
            raise
        except Exception as exc:
            raise FedltError(f"cannot split {_model_name(model)} at {where}: {_reason(exc)}") from exc

"""A stateful aggregator, added without touching fedlt: Lookahead on the server (Zhang et al.
2019, "Lookahead Optimizer: k steps forward, 1 step back").

The fast weights are FedAvg's average each round; every k-th round the slow weights φ (the
global weights before the first round, at first) move towards them, φ ← φ + α·(fast − φ), and the
global model becomes φ. State: φ (float64) and the round count, checkpointed and resumed exactly.
Registered through the entry point ``fedlt.aggregators: lookahead``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field, PrivateAttr

from fedlt.plugin import Aggregator, FedltError, State, weighted_average


class Lookahead(Aggregator):
    """Every ``k`` rounds φ ← φ + alpha·(fedavg − φ) and the global model is φ; in between the
    global model is FedAvg's average; defaults alpha 0.5, k 2 (the paper's α = 0.5)."""

    name: ClassVar[str] = "lookahead"
    alpha: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                                  description="step of the slow weights towards the fast ones")] = 0.5
    k: Annotated[int, Field(ge=1, strict=True, description="rounds between two slow-weight steps")] = 2

    _state: dict[str, Any] = PrivateAttr(default_factory=lambda: {"slow": {}, "count": 0})

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        slow = self._state["slow"]
        if not slow:  # φ starts at the global weights the federation started from
            slow.update({n: global_state[n].double().clone() for n in sorted(trainable)})
        out = weighted_average(results)
        self._state["count"] += 1
        if self._state["count"] % self.k == 0:
            for name in sorted(trainable):
                slow[name] += self.alpha * (out[name].double() - slow[name])
                out[name] = slow[name].to(out[name].dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"slow": {n: t.clone() for n, t in self._state["slow"].items()},
                "count": torch.tensor(self._state["count"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and set(state) != {"slow", "count"}:
            raise FedltError(f"lookahead: state must have keys ['count', 'slow'], got {sorted(state)}")
        self._state = {"slow": {n: t.double().clone() for n, t in state.get("slow", {}).items()},
                       "count": int(state.get("count", 0))}

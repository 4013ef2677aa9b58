"""DP-SGD inside a client's local training (``--privacy "sample_level(clip=C, noise_multiplier=σ)"``,
Abadi et al. 2016, Alg. 1; docs/privacy.md). Each local step of client k:

    batch:  every one of its n_k samples taken with probability q = b/n_k (Poisson sampling),
            b the batch the schedule would have used (the expected batch size)
    g_i   = ∇_θ ℓ(θ; x_i, y_i)                            (per sample: torch.func.vmap of grad)
    ḡ     = ( Σ_i g_i · min(1, C/‖g_i‖₂) + N(0, σ²C² I) ) / b
    θ     ← the optimiser's step on ḡ (momentum and weight decay are post-processing)

‖g_i‖₂ is over all trainable parameters together. The batch's size varies (it may be empty: the
step is the noise alone); the divisor is the fixed expected size b, as the accountant assumes.
The number of steps is the schedule's (``iters``, or ``epochs`` × its batches per epoch). The
noise is drawn from a generator of its own, seeded from (sampling seed, round, client), on the
model's device: a resumed round, or the client on another engine, draws the same.

Per-sample gradients come from ``torch.func`` (``functional_call`` + ``vmap(grad)``): no new
dependency, one batched backward per step, and fedlt's own loop, optimiser and generators stay as
they are (Opacus would wrap the module, the optimiser and the data loader).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedlt.datasets.source import to_device
from fedlt.losses.base import Composite, LossTerm


def steps_per_round(batch: int, n: int, iters: int | None, epochs: int | None, drop_last: bool = False) -> int:
    """The local steps a schedule takes on n samples (what DP-SGD takes too, each Poisson-sampled)."""
    if epochs is None:
        return int(iters or 0)
    per_epoch = n // batch if drop_last and n >= batch else -(-n // batch)
    return epochs * per_epoch


def poisson_batches(n: int, batch: int, steps: int, generator: torch.Generator,
                    device: torch.device | None = None) -> Iterator[torch.Tensor]:
    """``steps`` index batches, each sample in each with probability min(batch/n, 1), drawn on the
    host from ``generator`` (a host decision: the batch's size is known without a device sync)."""
    rate = min(batch / n, 1.0)
    for _ in range(steps):
        yield to_device((torch.rand(n, generator=generator) < rate).nonzero().squeeze(1), device)


def noise_generator(sampling_seed: int, round_index: int, cid: int, device: torch.device) -> torch.Generator:
    """The stream of one client's DP-SGD noise in one round (its own: the minibatch stream is untouched)."""
    words = np.random.SeedSequence([sampling_seed, round_index, cid, 0xD95D]).generate_state(2, np.uint32)
    return torch.Generator(device=device).manual_seed((int(words[0]) << 31) ^ int(words[1]))


def clipped_sum(grads: Sequence[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """Σ_i g_i · min(1, C/‖g_i‖₂) for per-sample gradients stacked along dim 0 (the norm over every
    tensor together; a zero gradient stays zero)."""
    flat = [g.reshape(len(g), -1) for g in grads]  # a 0-dim parameter (FedETF's β) too
    norms = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]).pow(2).sum(0).sqrt()
    factor = (clip / norms).clamp(max=1.0)  # C/0 = inf → 1
    # one (1×B)·(B×P) product a tensor: an einsum over the sample axis ran 10× slower on the CPU
    return [(factor.to(f.dtype) @ f).view(g.shape[1:]) for f, g in zip(flat, grads)]


def stateful_terms(objective: Any) -> list[str]:
    """The loss terms of ``objective`` that keep state between steps (SGB's collector): under vmap
    their state would move once per sample, not per step."""
    terms = [t for _, t in objective.flat_terms()] if isinstance(objective, Composite) else [objective]
    return [t.name for t in terms if type(t).state_dict is not LossTerm.state_dict]


class PrivateStep:
    """One client's DP-SGD steps in one round: ``backward`` leaves ḡ in every trainable parameter's
    ``.grad`` and returns the step's loss (the mean of the per-sample losses, for the metrics)."""

    def __init__(self, clip: float, noise_multiplier: float, batch: int, generator: torch.Generator) -> None:
        self.clip, self.std, self.batch, self.generator = clip, noise_multiplier * clip, batch, generator

    def per_sample(self, model: nn.Module, params: dict[str, torch.Tensor], objective: Any, x: torch.Tensor,
                   y: torch.Tensor, extra: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the per-sample gradients by parameter name, the per-sample losses): each sample's loss is
        the objective on a batch of that one sample."""
        fixed = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n not in params}
        teacher = extra.get("teacher_logits")

        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor,
                 ti: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            logits = functional_call(model, (p, fixed), (xi.unsqueeze(0),))
            kw: dict[str, Any] = {"teacher_logits": ti.unsqueeze(0)} if ti is not None else {}
            if "params" in extra:
                kw["params"] = list(p.values())
            value = objective(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits,
                              yi.unsqueeze(0), **kw)
            return value, value.detach()

        return vmap(grad(loss, has_aux=True), in_dims=(None, 0, 0, 0 if teacher is not None else None),
                    randomness="different")(params, x, y, teacher)

    def parts(self, model: nn.Module, params: Sequence[nn.Parameter], objective: Any, x: torch.Tensor,
              y: torch.Tensor, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``backward``, its loss under the objective's name (none for an empty batch)."""
        loss = self.backward(model, params, objective, x, y, extra)
        return {} if loss is None else {"objective": loss}

    def backward(self, model: nn.Module, params: Sequence[nn.Parameter], objective: Any, x: torch.Tensor,
                 y: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor | None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if len(y):
            grads, losses = self.per_sample(model, {n: p.detach() for n, p in zip(names, params)}, objective, x, y,
                                            extra)
            summed = clipped_sum([grads[n] for n in names], self.clip)
        else:  # an empty Poisson batch: the step is the noise alone
            summed, losses = [torch.zeros_like(p) for p in params], None
        for p, s in zip(params, summed):
            noise = torch.randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
            p.grad = (s + self.std * noise) / self.batch
        return None if losses is None else losses.mean()

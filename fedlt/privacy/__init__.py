"""Differential privacy for federated runs (SPEC §9, docs/privacy.md): the mechanisms that
``--privacy`` names and the accountant that turns them into ε at the run's δ.

- ``client_level(clip, noise_multiplier)``: DP-FedAvg (McMahan et al. 2018): each participant's
  update clipped to C (over all tensors together), the server averages with the fixed denominator
  qK (the expected number of participants; data-size weights would leak |D_k|) and adds
  N(0, (σC/(qK))²) to every coordinate of the average. ``adaptive=true``: C follows the
  ``target_quantile`` of the update norms (Andrew et al. 2021, Alg. 1): each participant also
  sends b_k = 1[‖Δ_k‖ ≤ C]; the server forms b̄ = (Σ b_k + N(0, σ_b²))/(qK) and sets
  C ← C·exp(−η_C·(b̄ − γ)); the update's noise multiplier becomes σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)
  so that both releases together cost what σ alone would (their Theorem 1).
- ``local(clip, noise_multiplier)``: each participant clips to C and adds N(0, (σC)²) itself
  before uploading (no trusted server).
- ``sample_level(clip, noise_multiplier)``: DP-SGD (Abadi et al. 2016) inside each client's local
  training (fedlt.privacy.dpsgd): Poisson-sampled minibatches, every sample's gradient clipped to
  C, their sum noised with N(0, (σC)²) and divided by the expected batch size.

Accounting: Google's ``dp-accounting`` (RDP accountant) — never a formula of fedlt's. fedlt samples
round(qK) clients without replacement each round, so the event is the library's
``SampledWithoutReplacementDpEvent`` under its REPLACE_ONE relation, where one client's change moves
the clipped sum by up to 2C: the library's noise multiplier (std / sensitivity) is σ/2.
``local`` releases every client's own noised update each round it takes part: per client, a
Gaussian mechanism composed over the rounds it could be sampled in (the accountant's bound for the
worst client, sampled every round). ``sample_level`` is accounted per client
(:class:`SampleAccountant`): each of its local steps is the library's
``PoissonSampledDpEvent(b_k/n_k, GaussianDpEvent(σ))`` under add/remove; the run's ε is the
largest client's.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fedlt.errors import FedltError
from fedlt.spec import SpecModel, parse_spec

Sampling = Literal["fixed", "poisson"]


class Mechanism(SpecModel):
    """A DP mechanism's parameters (``--privacy name(...)``)."""

    name: ClassVar[str] = "mechanism"
    central: ClassVar[bool] = True
    level: ClassVar[str] = "client"  # whose data a neighbouring dataset differs in: a client's, or one sample's
    clip: float = Field(1.0, gt=0, allow_inf_nan=False, description="C: the L2 bound of each client's update")
    noise_multiplier: float = Field(1.0, gt=0, allow_inf_nan=False, description="σ: noise std in units of C")

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, **self.params()}


class ClientLevel(Mechanism):
    """Central client-level DP (DP-FedAvg, McMahan et al. 2018), optionally with adaptive clipping
    (Andrew et al. 2021)."""

    name: ClassVar[str] = "client_level"
    adaptive: bool = Field(False, description="adapt C to the target quantile of the update norms (Andrew et al. 2021)")
    target_quantile: float = Field(0.5, gt=0, lt=1, allow_inf_nan=False, description="γ: the share of updates left unclipped")
    clip_lr: float = Field(0.2, gt=0, allow_inf_nan=False, description="η_C: the geometric step of the clip norm")
    count_noise: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      description="σ_b: noise std of the unclipped count (default qK/20, the paper's)")

    def count_std(self, expected: float) -> float:
        return self.count_noise if self.count_noise is not None else expected / 20

    def update_multiplier(self, expected: float) -> float:
        """σ_Δ: the update's noise multiplier once the count's release is paid for (Andrew et al. Thm 1)."""
        if not self.adaptive:
            return self.noise_multiplier
        rest = self.noise_multiplier ** -2 - (2 * self.count_std(expected)) ** -2
        if rest <= 0:
            raise FedltError(f"privacy: client_level's count_noise {self.count_std(expected):g} is too small for "
                             f"noise_multiplier {self.noise_multiplier:g} (need 2·σ_b > σ)")
        return rest ** -0.5


class Local(Mechanism):
    """Local client-level DP: each client clips to C and adds N(0, (σC)²) to its own upload."""

    name: ClassVar[str] = "local"
    central: ClassVar[bool] = False


class SampleLevel(Mechanism):
    """Sample-level DP: DP-SGD inside each client's local training (Abadi et al. 2016)."""

    name: ClassVar[str] = "sample_level"
    central: ClassVar[bool] = False
    level: ClassVar[str] = "sample"
    clip: float = Field(1.0, gt=0, allow_inf_nan=False, description="C: the L2 bound of each sample's gradient")
    noise_multiplier: float = Field(1.0, gt=0, allow_inf_nan=False,
                                    description="σ: std of the noise added to a step's clipped sum, in units of C")


MECHANISMS: dict[str, type[Mechanism]] = {"client_level": ClientLevel, "local": Local, "sample_level": SampleLevel}


def mechanism(spec: str | dict[str, Any]) -> Mechanism:
    """The mechanism a ``--privacy`` spec names (one-line FedltError for anything else)."""
    if isinstance(spec, str) and "+" in spec:
        raise FedltError("privacy: one mechanism a run (client_level, local or sample_level), not a '+' "
                         "composition (docs/privacy.md: sample- and client-level together)")
    spec = parse_spec(spec, "--privacy") if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", None)
    if name not in MECHANISMS:
        raise FedltError(f"privacy: unknown mechanism {name!r} (valid: {', '.join(MECHANISMS)})")
    return MECHANISMS[name](**spec)


# -- accounting -------------------------------------------------------------------------------------
def _accountant_library():
    try:
        import dp_accounting  # noqa: PLC0415  (optional: the privacy extra)
        from dp_accounting.rdp import rdp_privacy_accountant  # noqa: PLC0415
    except ImportError:
        raise FedltError("privacy accounting needs Google's dp-accounting: pip install 'fedlt[privacy]' "
                         "(or pip install --no-deps dp-accounting==0.6.0)") from None
    return dp_accounting, rdp_privacy_accountant


def subsampled_gaussian_event(noise_multiplier: float, steps: int, population: int, sample: int,
                              sampling: Sampling = "fixed") -> Any:
    """The dp-accounting event of ``steps`` rounds of the subsampled Gaussian mechanism:
    ``fixed``: ``sample`` of ``population`` without replacement (replace-one: multiplier σ/2);
    ``poisson``: each member with probability sample/population (add/remove: multiplier σ)."""
    dp, _ = _accountant_library()
    if sampling == "poisson":
        inner = dp.PoissonSampledDpEvent(sample / population, dp.GaussianDpEvent(noise_multiplier))
    else:
        inner = dp.SampledWithoutReplacementDpEvent(population, sample, dp.GaussianDpEvent(noise_multiplier / 2))
    return dp.SelfComposedDpEvent(inner, steps)


def _relation(sampling: Sampling) -> Any:
    dp, _ = _accountant_library()
    return dp.NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson" else dp.NeighboringRelation.REPLACE_ONE


@functools.lru_cache(maxsize=64)
def round_rdp(noise_multiplier: float, population: int, sample: int,
              sampling: Sampling = "fixed") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(orders, RDP at each order) of ONE round, as dp-accounting's RdpAccountant computes it (its
    default orders). The library composes rounds additively — ``SelfComposedDpEvent(e, n)`` is
    n × e's curve — so fedlt asks it once per setting (the sampled-without-replacement curve takes
    seconds) and composes by that same product (bit-identical: tests/test_privacy.py)."""
    _, rdp = _accountant_library()
    accountant = rdp.RdpAccountant(neighboring_relation=_relation(sampling))
    absl = logging.getLogger("absl")  # the library's notes on orders it excludes, once per order: not the user's
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(subsampled_gaussian_event(noise_multiplier, 1, population, sample, sampling))
    finally:
        absl.setLevel(level)
    return tuple(float(o) for o in accountant._orders), tuple(float(v) for v in accountant._rdp)


def epsilon(noise_multiplier: float, steps: int, population: int, sample: int, delta: float,
            sampling: Sampling = "fixed") -> float:
    """ε at δ after ``steps`` rounds, from dp-accounting's RDP accountant (0 before any round)."""
    if steps == 0:
        return 0.0
    _, rdp = _accountant_library()
    orders, curve = round_rdp(noise_multiplier, population, sample, sampling)
    return float(rdp.compute_epsilon(np.asarray(orders), steps * np.asarray(curve), delta)[0])


@functools.lru_cache(maxsize=64)
def calibrate(target_epsilon: float, delta: float, steps: int, population: int, sample: int,
              sampling: Sampling = "fixed", tol: float = 1e-3) -> float:
    """The smallest σ (to ``tol``) whose ε after ``steps`` rounds is at most ``target_epsilon``
    (dp-accounting's ``calibrate_dp_mechanism``)."""
    dp, rdp = _accountant_library()
    from dp_accounting import mechanism_calibration  # noqa: PLC0415

    return float(mechanism_calibration.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(neighboring_relation=_relation(sampling)),
        lambda sigma: subsampled_gaussian_event(sigma, steps, population, sample, sampling),
        target_epsilon, delta, mechanism_calibration.LowerEndpointAndGuess(0.1, 1.0), tol=tol))


def default_delta(clients: int) -> float:
    """δ = K^−1.1 for K clients: below 1/K, as a client-level guarantee needs (SPEC §9)."""
    return float(clients) ** -1.1


class Accountant:
    """The run's privacy ledger: the rounds composed so far (its state, in the checkpoint) and ε
    at δ after them. ``local`` composes a plain Gaussian over every round (the worst client, in
    each one); the central mechanisms the subsampled one over the rounds."""

    def __init__(self, mech: Mechanism, clients: int, per_round: int, delta: float) -> None:
        self.mech, self.clients, self.per_round, self.delta = mech, clients, per_round, delta
        self.multiplier = mech.update_multiplier(per_round) if isinstance(mech, ClientLevel) else mech.noise_multiplier
        self.rounds = 0

    def step(self) -> float:
        self.rounds += 1
        return self.epsilon()

    def epsilon(self) -> float:
        if self.mech.central:
            return epsilon(self.multiplier, self.rounds, self.clients, self.per_round, self.delta)
        # local: each release is a Gaussian of std σC on a C-bounded update, the worst client in every round
        return epsilon(self.multiplier, self.rounds, 1, 1, self.delta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"rounds": torch.tensor(self.rounds, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"]) if "rounds" in state else 0


Plan = tuple[int, int, int]  # one client's local steps in a round: (cid, |D_k| = n_k, expected batch b_k, steps)


class SampleAccountant:
    """Sample-level DP's ledger: every client's own Rényi-DP curve (dp-accounting's default
    orders), the sum of its steps' ``PoissonSampledDpEvent(b_k/n_k, GaussianDpEvent(σ))`` curves
    over the rounds it trained in — the library composes by that same sum — and ε at δ of each;
    the run's ε is the largest client's (a sample belongs to one client: its guarantee is its
    client's). The curves are the state (in the checkpoint): a resumed run reports the same ε."""

    def __init__(self, mech: Mechanism, delta: float) -> None:
        self.mech, self.delta, self.multiplier = mech, delta, mech.noise_multiplier
        self.curves: dict[int, np.ndarray] = {}
        self.epsilons: dict[int, float] = {}
        # one step's curve per (n_k, b_k), kept for the run: round_rdp's 64-entry cache would
        # recompute it (0.2–4 s each) every round once more than 64 client sizes take part
        self._step_curves: dict[tuple[int, int], np.ndarray] = {}

    def _added(self, cid: int, n: int, batch: int, steps: int) -> np.ndarray:
        key = (int(n), int(min(batch, n)))
        if key not in self._step_curves:
            self._step_curves[key] = np.asarray(round_rdp(self.multiplier, *key, "poisson")[1])
        return self.curves.get(cid, 0.0) + steps * self._step_curves[key]

    def _epsilon_of(self, curve: np.ndarray) -> float:
        _, rdp = _accountant_library()
        orders, _ = round_rdp(self.multiplier, 1, 1, "poisson")
        return float(rdp.compute_epsilon(np.asarray(orders), curve, self.delta)[0])

    def record(self, plans: Sequence[Plan]) -> float:
        """The round's clients' steps composed; the run's ε after them."""
        for cid, n, batch, steps in plans:
            if steps > 0:
                self.curves[cid] = self._added(cid, n, batch, steps)
                self.epsilons[cid] = self._epsilon_of(self.curves[cid])
        return self.epsilon()

    def epsilon(self) -> float:
        return max(self.epsilons.values(), default=0.0)

    def prospective(self, plans: Sequence[Plan]) -> float:
        """The run's ε were these clients to take these steps too (nothing recorded)."""
        after = [self._epsilon_of(self._added(cid, n, batch, steps)) for cid, n, batch, steps in plans if steps > 0]
        return max([self.epsilon(), *after])

    def state_dict(self) -> dict[str, torch.Tensor]:
        cids = sorted(self.curves)
        return {"sample_clients": torch.tensor(cids, dtype=torch.int64),
                "sample_rdp": torch.tensor(np.stack([self.curves[c] for c in cids]) if cids else np.zeros((0, 0)),
                                           dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curves = {int(c): np.asarray(curve.numpy(), dtype=np.float64)
                       for c, curve in zip(state.get("sample_clients", []), state.get("sample_rdp", []))}
        self.epsilons = {c: self._epsilon_of(curve) for c, curve in self.curves.items()}


def calibrate_sample_level(target_epsilon: float, delta: float, plans: Sequence[tuple[int, int, int]]) -> float:
    """The smallest σ whose every client stays at or below ``target_epsilon`` after its steps
    (``plans``: (n_k, b_k, steps over the run)): the largest of dp-accounting's calibrations per
    client. Clients are taken from the likely costliest (q²·T, the subsampled Gaussian's leading
    term) down; one whose ε at the σ found so far is already within the target is not calibrated
    (ε falls as σ grows, so it stays within), which leaves one calibration and one ε per other
    client instead of a calibration each (10 clients: minutes on a CPU)."""
    sigma = 0.0
    for n, batch, steps in sorted(set(plans), key=lambda p: -(min(p[1], p[0]) / p[0]) ** 2 * p[2]):
        if sigma and epsilon(sigma, steps, n, min(batch, n), delta, "poisson") <= target_epsilon:
            continue
        sigma = calibrate(target_epsilon, delta, steps, n, min(batch, n), "poisson")
    return sigma


def finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else float("inf")

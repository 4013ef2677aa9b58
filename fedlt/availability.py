"""Client availability (docs/faults.md): which clients can take part in a round, and how long a
participant takes on a simulated clock — components chosen by spec (``--availability
"bernoulli(p=0.7)"``), registered like every other kind (entry-point group ``fedlt.availability``).

Every answer is a function of (sampling seed, round, client id) — no state is carried — so a run
with dropouts is reproducible, and a resumed run sees exactly the drops the uninterrupted run saw.

``when`` says where availability acts:

- ``"before"`` sampling (cross-device FL): the server samples among the clients reachable this
  round; an unreachable client is never sampled.
- ``"after"`` sampling: the server samples among all clients; a sampled client that is not
  available fails during the round (a one-call client does not return; a split-learning client
  leaves the exchange at an iteration drawn from the same stream) and is dropped as
  ``unavailable``.

``duration`` is a participant's simulated round time in seconds, checked against the round
policy's ``round_timeout``: a client past the deadline is dropped as ``late``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from fedlt.errors import FedltError
from fedlt.registry import Registry

REGISTRY: Registry = Registry("availability", group="fedlt.availability")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

When = Literal["before", "after"]


def uniform(seed: int, round_index: int, cid: int, tag: int) -> float:
    """A uniform draw in [0, 1) from its own stream of (seed, round, client, what it decides)."""
    return float(np.random.default_rng([seed, round_index, cid, tag, 0xA7A1]).random())


def _check_when(name: str, when: Any) -> When:
    if when not in ("before", "after"):
        raise FedltError(f"availability {name!r}: when must be 'before' or 'after', got {when!r}")
    return when


def _probability(name: str, field: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 \
            or (positive and value == 0):
        bound = "(0, 1]" if positive else "[0, 1]"
        raise FedltError(f"availability {name!r}: {field} must be a number in {bound}, got {value!r}")
    return float(value)


class Availability:
    """Every client, every round, on time (the base: subclasses override what they change)."""

    name = "always"
    when: When = "before"
    acts = True  # False only for a model that never drops, delays or fails anyone (the engine skips it)

    def available(self, seed: int, round_index: int, cid: int) -> bool:
        return True

    def duration(self, seed: int, round_index: int, cid: int) -> float:
        return 0.0

    def fault(self, seed: int, round_index: int, cid: int) -> str | None:
        """A fault to inject into a reachable client's work: ``raise`` (its work fails) or ``nan``
        (it returns a non-finite update); None for none (only ``scripted`` injects)."""
        return None

    def check_run(self, clients: int, rounds: int | None = None) -> None:
        """Refuse (FedltError) settings that name a client the run does not have (RunConfig
        checks this) or, given ``rounds``, a round beyond it (``fedlt run`` checks a new run: a
        run cut early and resumed with more rounds keeps the faults of its later rounds)."""

    def leaves_at(self, seed: int, round_index: int, cid: int, iterations: int) -> int:
        """The local iteration (0-based) at which an unavailable split-learning client leaves."""
        return min(int(uniform(seed, round_index, cid, 2) * iterations), max(iterations - 1, 0))

    def __repr__(self) -> str:
        return self.name


@register("always")
class Always(Availability):
    """Every client takes part whenever it is sampled (no faults: fedlt's default)."""

    acts = False

    def __init__(self) -> None:
        """No parameters."""


@register("bernoulli")
class Bernoulli(Availability):
    """Each client is available in each round with probability ``p``, independently.

    Args:
        p: probability that a client is available in a round (0 < p <= 1).
        when: ``after`` sampling (default: a sampled client fails during the round) or ``before``
            (the server samples among the available).
    """

    name = "bernoulli"

    def __init__(self, p: float = 0.7, when: When = "after") -> None:
        self.p = _probability(self.name, "p", p, positive=True)
        self.when = _check_when(self.name, when)

    def available(self, seed: int, round_index: int, cid: int) -> bool:
        return uniform(seed, round_index, cid, 0) < self.p

    def __repr__(self) -> str:
        return f"bernoulli(p={self.p:g}, when={self.when!r})"


@register("markov")
class Markov(Availability):
    """Each client is a two-state chain over rounds: an offline client comes back with
    probability ``p_on`` per round, an online one goes away with probability ``p_off``; round 0
    starts from the stationary share p_on / (p_on + p_off) online. Clients that leave stay away
    for 1/p_on rounds on average.

    Args:
        p_on: probability that an offline client is back the next round.
        p_off: probability that an online client is gone the next round.
        when: ``after`` sampling (default) or ``before`` it (see the module).
    """

    name = "markov"

    def __init__(self, p_on: float = 0.8, p_off: float = 0.3, when: When = "after") -> None:
        self.p_on = _probability(self.name, "p_on", p_on, positive=True)
        self.p_off = _probability(self.name, "p_off", p_off)
        self.when = _check_when(self.name, when)
        self._seen: dict[tuple[int, int], tuple[int, bool]] = {}

    def available(self, seed: int, round_index: int, cid: int) -> bool:
        return self._state(seed, round_index, cid)

    def _state(self, seed: int, round_index: int, cid: int) -> bool:
        """The chain walked forward from the nearest earlier round asked before (a cache of a pure
        function of the stream: derived, never state), else from round 0."""
        start, state = self._seen.get((seed, cid), (-1, False))
        if start > round_index:
            start, state = -1, False
        for r in range(start + 1, round_index + 1):
            if r == 0:
                state = uniform(seed, 0, cid, 1) < self.p_on / (self.p_on + self.p_off)
            else:
                draw = uniform(seed, r, cid, 1)
                state = draw >= self.p_off if state else draw < self.p_on
        self._seen[(seed, cid)] = (round_index, state)
        return state

    def __repr__(self) -> str:
        return f"markov(p_on={self.p_on:g}, p_off={self.p_off:g}, when={self.when!r})"


@register("straggler")
class Straggler(Availability):
    """A fixed share of the clients (chosen once per run by the seed) are slow: a participant's
    simulated round time is ``base`` seconds, times ``slowdown`` for a straggler, times a jitter
    uniform in [1, 1 + ``jitter``]; past the round policy's ``round_timeout`` it is dropped as
    ``late``. Every client is reachable.

    Args:
        fraction: share of the clients that are stragglers.
        slowdown: how many times longer a straggler's round takes.
        base: a normal client's simulated round time in seconds.
        jitter: relative spread of every client's round time.
    """

    name = "straggler"
    when: When = "after"

    def __init__(self, fraction: float = 0.2, slowdown: float = 5.0, base: float = 1.0, jitter: float = 0.1) -> None:
        self.fraction = _probability(self.name, "fraction", fraction)
        for field, value in (("slowdown", slowdown), ("base", base), ("jitter", jitter)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise FedltError(f"availability {self.name!r}: {field} must be a finite number >= 0, got {value!r}")
        self.slowdown, self.base, self.jitter = float(slowdown), float(base), float(jitter)

    def duration(self, seed: int, round_index: int, cid: int) -> float:
        slow = uniform(seed, 0, cid, 3) < self.fraction  # tag 3 at round 0 only: the same for every round
        return self.base * (self.slowdown if slow else 1.0) * (1.0 + self.jitter * uniform(seed, round_index, cid, 4))

    def __repr__(self) -> str:
        return f"straggler(fraction={self.fraction:g}, slowdown={self.slowdown:g})"


@register("scripted")
class Scripted(Availability):
    """Exactly the listed faults, each a list of ``[round, client]`` pairs (round counted from 1,
    as in metrics.jsonl): ``drops`` are unavailable in that round; ``fails`` have their work
    raise an error inside the client (on a Flower node too); ``corrupts`` return a non-finite
    update — for reproducing a failure scenario and for tests.

    Args:
        drops: ``[round, client]`` pairs, each an unavailable client in a round (1-based round).
        fails: ``[round, client]`` pairs whose client work raises an error.
        corrupts: ``[round, client]`` pairs whose client returns a non-finite update.
        when: ``before`` sampling or ``after`` it, for ``drops`` (see the module).
    """

    name = "scripted"

    def __init__(self, drops: Any = (), fails: Any = (), corrupts: Any = (), when: When = "after") -> None:
        self.drops, self.fails, self.corrupts = (_pairs(field, value) for field, value in
                                                 (("drops", drops), ("fails", fails), ("corrupts", corrupts)))
        self.when = _check_when(self.name, when)

    def available(self, seed: int, round_index: int, cid: int) -> bool:
        return (round_index + 1, cid) not in self.drops

    def fault(self, seed: int, round_index: int, cid: int) -> str | None:
        key = (round_index + 1, cid)
        return "raise" if key in self.fails else "nan" if key in self.corrupts else None

    def check_run(self, clients: int, rounds: int | None = None) -> None:
        """A scripted fault of a client or a round that does not exist would never happen: a typo
        in a failure scenario, refused instead of a run that silently tests nothing."""
        for field in ("drops", "fails", "corrupts"):
            for r, c in sorted(getattr(self, field)):
                if c >= clients:
                    raise FedltError(f"availability 'scripted': {field} names client {c} (round {r}), but the run "
                                     f"has {clients} client(s): 0 to {clients - 1}")
                if rounds is not None and r > rounds:
                    raise FedltError(f"availability 'scripted': {field} names round {r} (client {c}), but the run "
                                     f"has {rounds} round(s): 1 to {rounds}")

    def __repr__(self) -> str:
        return f"scripted(drops={sorted(map(list, self.drops))}, when={self.when!r})"


def _pairs(field: str, value: Any) -> frozenset[tuple[int, int]]:
    try:
        pairs = [(r, c) for r, c in value]
    except (TypeError, ValueError):
        raise FedltError(f"availability 'scripted': {field} must be [round, client] pairs, got {value!r}") from None
    if any(isinstance(x, bool) or not isinstance(x, int) for pair in pairs for x in pair) \
            or any(r < 1 or c < 0 for r, c in pairs):
        raise FedltError(f"availability 'scripted': {field} are [round, client] integer pairs, rounds from 1 and "
                         f"clients from 0, got {value!r}")
    return frozenset(pairs)

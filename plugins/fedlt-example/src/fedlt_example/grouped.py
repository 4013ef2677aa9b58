"""A split-learning server side, added without touching fedlt: participants' activations in
server forwards of ``size`` participants each — between SCALA's one concatenated forward
(``concat``) and SplitFed V2's one forward per participant (``sequential``).

Each group's forward takes the server loss over the group's concatenated activations and every
member's client loss from the same logits (SCALA's rule, per group); the server steps after each
group. Registered through the entry point ``fedlt.split_servers: grouped``; composes with every
client session and loss (``--algo scala`` with ``server="grouped(size=2)"``).
"""

from __future__ import annotations

from fedlt.plugin import FedltError, ServerSide


class Grouped(ServerSide):
    """Server forwards of ``size`` participants each, in the round's task order (default 2)."""

    def __init__(self, size: int = 2) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise FedltError(f"split server 'grouped': size must be an integer >= 1, got {size!r}")
        self.size = size

    def groups(self) -> list[list[int]]:
        n = len(self.tasks)
        return [list(range(start, min(start + self.size, n))) for start in range(0, n, self.size)]

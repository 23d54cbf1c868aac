"""Which active clients refresh their tracking terms in a round (the subset Y_t of S_t).

Y_t is drawn uniformly without replacement from the round's active clients with a
generator seeded by ``derive_seed`` over the round's per-client seeds. Those seeds
are ``derive_seed(seed, round, client)``, so Y_t is a function of (seed, round)
alone: identical after a resume and for any order or split of client execution.

docs/algorithms.md, (12.1).
"""

from __future__ import annotations

import torch

from fl_lightning.core.participation import RoundPlan, derive_seed

_TRACKING_STREAM = 0x7EAC


class TrackingSubset:
    """Size of Y_t: an int count in [0, S], or a float fraction of S in [0, 1] (rounded).

    Args:
        tracking: the setting's value; ``0.5`` is the paper's Y = S/2.
        name: the setting's name, used in error messages.
    """

    def __init__(self, tracking: int | float, name: str = "tracking") -> None:
        if isinstance(tracking, bool) or not isinstance(tracking, (int, float)):
            raise ValueError(
                f"{name} must be an int count >= 0 or a float fraction in [0, 1] of the active clients, got {tracking!r}"
            )
        if isinstance(tracking, float) and not 0.0 <= tracking <= 1.0:
            raise ValueError(f"{name} as a fraction of the active clients must be in [0, 1], got {tracking}")
        if isinstance(tracking, int) and tracking < 0:
            raise ValueError(f"{name} must be >= 0, got {tracking}")
        self.tracking = tracking
        self.name = name

    def count(self, num_active: int) -> int:
        """|Y_t| for a round with ``num_active`` clients; raises if a count exceeds it."""
        if isinstance(self.tracking, float):
            return int(round(self.tracking * num_active))
        if self.tracking > num_active:
            raise ValueError(
                f"{self.name}={self.tracking} exceeds the {num_active} active clients of the round; "
                f"allowed range is 0..{num_active} (or a fraction in [0, 1])"
            )
        return self.tracking

    def select(self, plan: RoundPlan) -> frozenset[int]:
        """Client ids in Y_t for the round ``plan``."""
        if plan is None:
            raise ValueError(f"{self.name}: the round's plan is needed to choose Y_t (RoundInfo.plan is None)")
        count = self.count(len(plan.clients))
        if count == 0:
            return frozenset()
        seed = derive_seed(_TRACKING_STREAM, plan.round, *plan.seeds.tolist())
        order = torch.randperm(len(plan.clients), generator=torch.Generator().manual_seed(seed))
        return frozenset(int(plan.clients[i]) for i in order[:count])

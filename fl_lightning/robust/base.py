"""The robust-aggregation contract (docs/algorithms.md (26.1.1)).

A ``RobustRule`` sees the round's decoded uploads as one matrix ``V`` ``[n, d]``: row i is client i's
whole upload (every entry the algorithm uploads, e.g. SCAFFOLD's ``delta`` and ``delta_c``, each
flattened, concatenated in the upload's order), and its aggregation weights ``w`` ``[n]`` (summing to
1). It returns one vector r ``[d]``, the robust estimate of the mean upload, which stands for every
upload in the algorithm's own ``upload_sum`` (``fl_lightning/robust/aggregation.py``). Every rule
therefore treats the entries *jointly*: one selection, one norm, one distance per client over the
whole upload; the coordinate-wise rules (median, trimmed mean, Bulyan's second step) are per
coordinate and so indifferent to the grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


@dataclass
class Combined:
    """A rule's output: the robust vector r, and for selecting rules the kept rows (ascending)."""

    vector: Tensor
    kept: list[int] | None = None


class RobustRule:
    """One robust aggregation rule. Subclasses set ``name`` and write ``combine``.

    ``needs_majority``: the rule's guarantee needs f < n / 2 (refused otherwise);
    ``min_clients(f)``: the fewest reporting clients it needs with f attackers (1: none).
    """

    name: ClassVar[str] = "rule"
    needs_majority: ClassVar[bool] = False
    selects: ClassVar[bool] = False  # Krum, Multi-Krum, Bulyan: reports which clients it kept

    def min_clients(self, f: int) -> int:
        return 2 * f + 1 if self.needs_majority else 1

    def requirement(self, f: int) -> str:
        """The assumption on n and f, as written in the refusal."""
        return "n > 2f" if self.needs_majority else "n >= 1"

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Tensor]:
        """Server-held state to checkpoint (centered clipping's center)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore ``state_dict``'s output on resume."""


def coordinate_median(V: Tensor) -> Tensor:
    """The coordinate-wise median of the rows, the mean of the two middle values for an even count."""
    s = torch.sort(V, dim=0).values
    n = V.shape[0]
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def pairwise_sq_dists(V: Tensor) -> Tensor:
    """``D[i, j] = ||V_i - V_j||^2`` computed row by row (exact, no Gram-matrix cancellation)."""
    return torch.stack([((V - V[i]) ** 2).sum(dim=1) for i in range(V.shape[0])])

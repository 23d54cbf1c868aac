"""Krum and Multi-Krum (Blanchard et al., NeurIPS 2017), docs/algorithms.md (26.1.4)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule, pairwise_sq_dists


def krum_scores(V: Tensor, f: int) -> Tensor:
    """s(i) = sum of the squared distances from V_i to its k = max(n - f - 2, 1) nearest other rows."""
    n = V.shape[0]
    k = max(n - f - 2, 1)
    D = pairwise_sq_dists(V)
    others = [torch.cat([D[i, :i], D[i, i + 1 :]]) for i in range(n)]
    return torch.stack([torch.sort(o).values[:k].sum() for o in others])


def krum_select(V: Tensor, f: int, m: int) -> list[int]:
    """The m rows of smallest Krum score (ties: the lower index), ascending."""
    order = torch.sort(krum_scores(V, f), stable=True).indices[:m]
    return sorted(order.tolist())


class MultiKrum(RobustRule):
    """Keep the m clients of smallest Krum score and average them (unweighted); m = 1 is Krum.

    Needs n > 2f + 2. ``m`` None: n - f (Blanchard et al.'s choice); 1 <= m <= n - f.
    """

    name = "multi_krum"
    selects = True

    def __init__(self, m: int | None = None) -> None:
        if m is not None and m < 1:
            raise ValueError(f"robust.m must be an integer >= 1 (or null for n - f), got {m}")
        self.m = m

    def min_clients(self, f: int) -> int:
        return max(2 * f + 3, (self.m or 1) + f)

    def requirement(self, f: int) -> str:
        return "n > 2f + 2" + (f" and m <= n - f (m={self.m})" if self.m is not None else "")

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        m = self.m if self.m is not None else V.shape[0] - f
        kept = krum_select(V, f, m)
        return Combined(V[kept].mean(dim=0), kept)


class Krum(MultiKrum):
    """Keep the one client of smallest Krum score."""

    name = "krum"

    def __init__(self) -> None:
        super().__init__(1)

    def requirement(self, f: int) -> str:
        return "n > 2f + 2"

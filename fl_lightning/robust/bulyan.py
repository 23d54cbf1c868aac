"""Bulyan (El Mhamdi et al., ICML 2018), docs/algorithms.md (26.1.5)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule, coordinate_median
from fl_lightning.robust.krum import krum_scores


class Bulyan(RobustRule):
    """Select theta = n - 2f clients by Krum repeatedly (each time the best of the remaining, scored
    among the remaining), then per coordinate average the beta = theta - 2f selected values closest to
    their median. Needs n >= 4f + 3."""

    name = "bulyan"
    selects = True

    def min_clients(self, f: int) -> int:
        return 4 * f + 3

    def requirement(self, f: int) -> str:
        return "n >= 4f + 3"

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        n = V.shape[0]
        remaining, kept = list(range(n)), []
        for _ in range(n - 2 * f):
            if len(remaining) == 1:
                best = 0
            else:
                best = int(torch.argmin(krum_scores(V[remaining], f)))
            kept.append(remaining.pop(best))
        kept.sort()
        S = V[kept]
        beta = len(kept) - 2 * f
        med = coordinate_median(S)
        closest = torch.sort((S - med).abs(), dim=0, stable=True).indices[:beta]
        return Combined(torch.gather(S, 0, closest).mean(dim=0), kept)

"""Min-sum (Shejwalkar and Houmansadr, NDSS 2021; docs/algorithms.md, (26.2.9)): mu + gamma p with the
largest gamma whose sum of squared distances to the benign uploads is within the smallest benign one's."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.adversary.base import RoundView
from fl_lightning.adversary.gamma_search import EXACT, largest_gamma, perturbation_of
from fl_lightning.adversary.min_max import MinMax


class MinSum(MinMax):
    """u_m -> mu + gamma p, sum_i ||u_m - g_i||^2 <= min_i sum_j ||g_i - g_j||^2 (settings as ``MinMax``)."""

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        mu, p = benign.mean(0), perturbation_of(benign, self.perturbation)
        threshold = (torch.cdist(benign, benign, compute_mode=EXACT) ** 2).sum(1).min()

        def within(m: Tensor) -> bool:
            return bool((torch.cdist(m[None], benign, compute_mode=EXACT) ** 2).sum() <= threshold)

        gamma = largest_gamma(within, mu, p, self.gamma_init, self.tau)
        return (mu + gamma * p).expand_as(own).clone()

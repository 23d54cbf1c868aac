"""PropFair, proportional fairness (Zhang, Malekmohammadi, Chen, Yu, TMLR 2023): clients minimise -log(M - loss), so a
client's gradient is scaled by 1 / (M - loss) and the clients served worst move most; aggregation is FedAvg's.

Rule: docs/algorithms.md, section 30, (30.10)-(30.12).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import LossContext, ModelOutputs
from fl_lightning.algorithms.fedavg import FedAvg


class PropFair(FedAvg):
    """Local loss: the Huberized surrogate (30.11) of the batch's mean cross-entropy f: -log(M - f) where
    M - f >= epsilon, else its tangent line at M - f = epsilon, -log(epsilon) + (f - M + epsilon) / epsilon.

    Args:
        baseline: M, > 0: the utility M - f is what the clients' log-product maximises.
        epsilon: the Huberization threshold, in (0, M).
        global_lr: server learning rate.
    """

    elementwise = True
    local_loss_ignores_padded_rows = True  # its only reduction over the rows is cross-entropy, which ignores padded rows
    record_level_dp = False  # a function of the batch's mean loss, not a sum of per-example terms

    def __init__(self, baseline: float = 5.0, epsilon: float = 0.2, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(baseline, bool) or not isinstance(baseline, int | float) or not 0 < baseline < math.inf:
            raise ValueError(f"PropFair baseline must be a number > 0, got {baseline!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not 0 < epsilon < baseline:
            raise ValueError(f"PropFair epsilon must be in (0, baseline={baseline}), got {epsilon!r}")
        self.baseline, self.epsilon = float(baseline), float(epsilon)

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        utility = self.baseline - F.cross_entropy(out.logits, target)  # M - f
        # the clamp keeps log's branch finite where the linear one is taken (a NaN there would reach the gradient)
        log_branch = -torch.log(utility.clamp(min=self.epsilon))
        linear_branch = -math.log(self.epsilon) - (utility - self.epsilon) / self.epsilon
        return {"propfair": torch.where(utility >= self.epsilon, log_branch, linear_branch)}

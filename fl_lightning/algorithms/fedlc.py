"""FedLC, logit calibration for label distribution skew (Zhang et al., ICML 2022).

Rule: docs/algorithms.md, section 21.4, (21.5); tau = 0 is FedAvg.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import LossContext, ModelOutputs
from fl_lightning.algorithms.fedavg import FedAvg

ABSENT_COUNT = 1e-8
"""The count a class the client has no samples of enters the calibration with (its logit is pulled down hard)."""


class FedLC(FedAvg):
    """Local loss: cross-entropy of the calibrated logits z_c - tau * n_{i,c}^(-1/4), n_{i,c} the
    client's training samples of class c (``ctx.label_counts``).

    Args:
        tau: calibration strength, >= 0 (0 is FedAvg).
        global_lr: server learning rate.
    """

    elementwise = True
    needs_label_counts = True
    local_loss_ignores_padded_rows = True  # its only reduction over the rows is cross-entropy, which ignores padded rows

    def __init__(self, tau: float = 1.0, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not tau >= 0:
            raise ValueError(f"FedLC tau must be >= 0, got {tau}")
        self.tau = tau

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        shift = self.tau * ctx.label_counts.to(out.logits.dtype).clamp(min=ABSENT_COUNT).pow(-0.25)
        return {"calibrated_ce": F.cross_entropy(out.logits - shift, target)}

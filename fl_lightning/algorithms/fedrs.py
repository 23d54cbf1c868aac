"""FedRS, restricted softmax (Li & Zhan, KDD 2021).

Rule: docs/algorithms.md, section 21.5, (21.6); alpha = 1 is FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import LossContext, ModelOutputs
from fl_lightning.algorithms.fedavg import FedAvg


class FedRS(FedAvg):
    """Local loss: cross-entropy of the logits with those of the classes the client has no samples
    of (``ctx.label_counts``) scaled by alpha, so that their softmax is restricted.

    Args:
        alpha: scaling of the missing classes' logits, in [0, 1] (1 is FedAvg).
        global_lr: server learning rate.
    """

    elementwise = True
    needs_label_counts = True
    local_loss_ignores_padded_rows = True  # its only reduction over the rows is cross-entropy, which ignores padded rows

    def __init__(self, alpha: float = 0.5, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not 0 <= alpha <= 1:
            raise ValueError(f"FedRS alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        scale = torch.where(ctx.label_counts > 0, 1.0, self.alpha).to(out.logits.dtype)
        return {"restricted_ce": F.cross_entropy(out.logits * scale, target)}

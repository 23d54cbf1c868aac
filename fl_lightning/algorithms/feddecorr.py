"""FedDecorr, decorrelation of the representation's dimensions (Shi et al., ICLR 2023).

Rule: docs/algorithms.md, section 21.6, (21.7); beta = 0 is FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import LossContext, ModelOutputs
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core.local_loss import real_rows

EPS = 1e-8


def decorrelation(z: Tensor, real: Tensor | None = None) -> Tensor:
    """The mean squared off-diagonal entry of the batch's correlation matrix K = Zs^T Zs, over N
    (Zs: z standardized per dimension over the batch's N samples, unbiased variance). ``real`` (bool ``[B]``,
    masked stacking's padded batch): the statistics of the real rows only, the padded rows' Zs zero."""
    n, d = z.shape
    if real is None:
        standardized = (z - z.mean(0, keepdim=True)) / torch.sqrt(EPS + z.var(0, keepdim=True))
    else:
        weight = real.to(z.dtype).unsqueeze(1)
        n = weight.sum()
        centred = (z - (z * weight).sum(0, keepdim=True) / n) * weight
        standardized = centred / torch.sqrt(EPS + centred.square().sum(0, keepdim=True) / (n - 1))
    corr = standardized.T @ standardized
    off_diagonal = corr * (1 - torch.eye(d, dtype=z.dtype, device=z.device))
    return off_diagonal.square().sum() / (d * (d - 1)) / n


class FedDecorr(FedAvg):
    """Local loss CE + beta * L_decorr(z), z the representation of the batch.

    Args:
        beta: weight of the decorrelation term, >= 0 (0 is FedAvg).
        global_lr: server learning rate.
    """

    elementwise = True
    needs_features = True
    local_loss_ignores_padded_rows = True  # the statistics over the real rows only

    def __init__(self, beta: float = 0.1, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not beta >= 0:
            raise ValueError(f"FedDecorr beta must be >= 0, got {beta}")
        self.beta = beta

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        return {"ce": F.cross_entropy(out.logits, target), "decorrelation": self.beta * decorrelation(out.features, real_rows(target, ctx))}

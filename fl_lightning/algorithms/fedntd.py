"""FedNTD, federated not-true distillation (Lee et al., NeurIPS 2022).

Rule: docs/algorithms.md, section 21.3, (21.4); beta = 0 is FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import LossContext, ModelOutputs
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core.local_loss import row_mean


def not_true(logits: Tensor, target: Tensor) -> Tensor:
    """The logits of every class but the sample's true one, in class order: ``[B, C-1]``."""
    others = torch.arange(logits.shape[-1] - 1, device=logits.device)
    return logits.gather(-1, others + (others >= target.unsqueeze(-1)).long())


class FedNTD(FedAvg):
    """Local loss CE + beta * tau^2 KL(q~_g || q~), q~ the softmax at temperature tau over the not-true
    classes, of the global model (q~_g, the teacher, evaluated on the same batch) and of the client's.

    Args:
        beta: weight of the distillation term, >= 0 (0 is FedAvg).
        tau: temperature, > 0.
        global_lr: server learning rate.
    """

    elementwise = True
    local_loss_ignores_padded_rows = True  # the KL mean by row_mean; a padded row's not-true classes read class 0
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)

    def __init__(self, beta: float = 1.0, tau: float = 1.0, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not beta >= 0:
            raise ValueError(f"FedNTD beta must be >= 0, got {beta}")
        if not tau > 0:
            raise ValueError(f"FedNTD tau must be > 0, got {tau}")
        self.beta, self.tau = beta, tau

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        teacher = ctx.evaluate(ctx.broadcast["x"]).logits.detach()
        classes = target.clamp(min=0) if ctx.padded_rows else target  # a padded row (-100) is left out by row_mean
        log_q = F.log_softmax(not_true(out.logits, classes) / self.tau, -1)
        log_q_global = F.log_softmax(not_true(teacher, classes) / self.tau, -1)
        kl = row_mean((log_q_global.exp() * (log_q_global - log_q)).sum(-1), target, ctx)
        return {"ce": F.cross_entropy(out.logits, target), "ntd": self.beta * self.tau**2 * kl}

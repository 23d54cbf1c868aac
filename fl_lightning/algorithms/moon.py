"""MOON, model-contrastive federated learning (Li, He & Song, CVPR 2021).

Rule: docs/algorithms.md, section 21.2, (21.2)-(21.3); mu = 0 is FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, LossContext, ModelOutputs, Payload
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core.local_loss import row_mean
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class MOON(FedAvg):
    """Local loss CE + mu * l_con, l_con contrasting the representation z with the global model's
    (positive) and with the client's previous local model's (negative) on the same batch.

    The client's previous model is client state: at a client's first round it is the global model
    (the two similarities coincide, l_con = log 2 with zero gradient: MOON's code leaves the term out).

    Args:
        mu: weight of the contrastive term, >= 0 (0 is FedAvg).
        tau: temperature, > 0.
        global_lr: server learning rate.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    needs_features = True
    local_loss_ignores_padded_rows = True  # the contrastive mean by row_mean

    def __init__(self, mu: float = 1.0, tau: float = 0.5, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not mu >= 0:
            raise ValueError(f"MOON mu must be >= 0, got {mu}")
        if not tau > 0:
            raise ValueError(f"MOON tau must be > 0, got {tau}")
        self.mu, self.tau = mu, tau

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"previous": P.detach_clone(x)}

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        z = out.features
        z_global = ctx.evaluate(ctx.broadcast["x"]).features
        z_previous = ctx.evaluate(ctx.client_state["previous"]).features
        logits = torch.stack([F.cosine_similarity(z, z_global, dim=-1), F.cosine_similarity(z, z_previous, dim=-1)], -1) / self.tau
        contrastive = row_mean(torch.logsumexp(logits, -1) - logits[..., 0], target, ctx)  # -log softmax of the positive pair
        return {"ce": F.cross_entropy(out.logits, target), "contrastive": self.mu * contrastive}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {"previous": params}

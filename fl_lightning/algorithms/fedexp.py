"""FedExP, extrapolated server step size (Jhunjhunwala, Wang, Joshi, ICLR 2023, Alg. 1).

Rule: docs/algorithms.md, section 23, (23.1)-(23.2); the step is >= 1 and equal clients give 1 (E17).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def extrapolation(sq_norms: Sequence[float], weights: Sequence[float], mean_sq_norm: float, eps: float) -> float:
    """(23.1): max(1, sum_i w_i ||Delta_i||^2 / (2 (||sum_i w_i Delta_i||^2 + eps)))."""
    return max(1.0, sum(w * s for w, s in zip(weights, sq_norms)) / (2.0 * (mean_sq_norm + eps)))


class FedExP(Algorithm):
    """Client: local SGD (as FedAvg). Server: x <- x + eta_g * Delta with Delta = sum_i w_i Delta_i and
    eta_g from the uploads' spread (23.1); ``global_lr`` multiplies it (1: the paper's step).

    The step is kept in the server state and logged as ``algo/step_size``.

    Args:
        eps: epsilon > 0 of (23.1) (the paper tunes it per task; 1e-3 is its most common value).
        global_lr: a constant factor on the extrapolated step (default 1).
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = False  # (23.1) reads every upload's squared norm beside their sum

    def __init__(self, eps: float = 1e-3, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not eps > 0:
            raise ValueError(f"FedExP eps must be > 0, got {eps}")
        self.eps = eps

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {"fedexp": {"step_size": torch.ones((), dtype=torch.float64)}}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        return sgd_step(params, grad, ctx.lr), local

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        """(23.2): d = -eta_g sum_i w_i Delta_i, eta_g of (23.1) in float64."""
        deltas = P.part(uploads, "delta")
        mean = P.weighted_sum(deltas, weights)
        step = extrapolation(P.row_sq_norms(deltas), [float(w) for w in weights], float(P.sq_norm(mean)), self.eps)
        state = {"fedexp": {"step_size": torch.tensor(step, dtype=torch.float64)}}
        return P.scale(mean, -step), state

    def metrics(self, server_state: NestedState, info: RoundInfo) -> dict[str, float]:
        """``algo/step_size``: the round's extrapolated server step eta_g of (23.1)."""
        return {"step_size": float(server_state["fedexp"]["step_size"])}

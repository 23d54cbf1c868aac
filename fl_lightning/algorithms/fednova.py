"""FedNova, normalized averaging (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020).

Rule: docs/algorithms.md, section 22, (22.1)-(22.3); equal K_i with rho = 0 is FedAvg (E16).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def norm_a(steps: int, rho: float) -> float:
    """||a_i||_1 of (22.2): K for plain SGD, [K - rho (1 - rho^K) / (1 - rho)] / (1 - rho) with momentum rho."""
    if rho == 0:
        return float(steps)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


class FedNova(Algorithm):
    """Client: K_i steps of SGD with momentum rho (v <- rho v + g, x_i <- x_i - eta_l v).

    Server: x <- x + eta_g tau_eff sum_i w_i Delta_i / ||a_i||_1 with tau_eff = sum_i w_i ||a_i||_1,
    ||a_i||_1 from the client's step count K_i (the ``local_steps`` ``aggregate`` receives).

    Args:
        momentum: rho in [0, 1), the clients' local (heavy-ball) momentum.
        global_lr: server learning rate eta_g.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = False  # the weights w_i / ||a_i||_1 need each client's K_i beside its upload

    def __init__(self, momentum: float = 0.0, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"FedNova momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"v": P.zeros_like(params)} if self.momentum else {}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        if not self.momentum:
            return sgd_step(params, grad, ctx.lr), local
        v = {k: self.momentum * local["v"][k] + grad[k] for k in grad}
        return sgd_step(params, v, ctx.lr), {"v": v}

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        """(22.3): d = -tau_eff sum_i w_i Delta_i / ||a_i||_1."""
        norms = [norm_a(k, self.momentum) for k in local_steps]
        w = [float(wi) for wi in weights]
        tau_eff = sum(wi * a for wi, a in zip(w, norms))
        normalized = P.weighted_sum(P.part(uploads, "delta"), [wi / a for wi, a in zip(w, norms)])
        return P.scale(normalized, -tau_eff), server_state

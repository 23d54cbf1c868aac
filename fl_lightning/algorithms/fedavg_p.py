"""FedAvg-P, FedSim and FedAlt: partial model personalization, shared u federated, personal v_i kept.

FedAvg-P: Chen, Cao, Yuan and Wen 2023 (partial personalization, FedAvg-P / Scaffold-P),
Algorithm 1; FedSim and FedAlt: Pillutla et al. 2022. Rules: docs/algorithms.md, section 14,
(14.1)-(14.5); reduction to FedAvg: E5. ``params`` in the client rule holds u_i and v_i; ``ctx.personal``
holds v_i^t and names the personal tensors. gamma_u = ``local.lr``, gamma_v =
``local.personal_lr`` (default gamma_u); eta_u is the server step (``global_lr``).
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def split_sgd_step(params: TensorDict, direction: TensorDict, ctx: ClientContext) -> TensorDict:
    """u <- u - gamma_u d_u,  v <- v - gamma_v d_v  (Alg. 1 lines 6-7)."""
    lr_u, lr_v = ctx.lr, ctx.personal_lr
    return {k: p - (lr_v if k in ctx.personal else lr_u) * direction[k] for k, p in params.items()}


class FedAvgP(Algorithm):
    """FedAvg-P (Alg. 1): K simultaneous SGD steps on (u_i, v_i);
    v_i <- (1 - eta_v) v_i + eta_v v_{i,K} (line 9); u <- (1 - eta_u) u + (eta_u/m) sum_S u_i (line 11).

    Args:
        eta_u: outer step size of the shared tensors (> 0), the server lr.
        eta_v: outer step size of the personal tensors (> 0).
    """

    supports_personal = True

    def __init__(self, eta_u: float = 1.0, eta_v: float = 1.0) -> None:
        if not eta_u > 0:
            raise ValueError(f"FedAvgP eta_u must be > 0, got {eta_u}")
        if not eta_v > 0:
            raise ValueError(f"FedAvgP eta_v must be > 0, got {eta_v}")
        super().__init__(global_lr=eta_u)
        self.eta_u, self.eta_v = eta_u, eta_v

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        return split_sgd_step(params, grad, ctx), local

    def personal_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> TensorDict:
        if self.eta_v == 1.0:  # v_{i,K} exactly
            return super().personal_finish(params, local, ctx)
        return {k: v + self.eta_v * (params[k] - v) for k, v in ctx.personal.items()}


class FedSim(FedAvgP):
    """FedSim (Pillutla et al. 2022) = FedAvg-P with eta_u = eta_v = 1."""

    def __init__(self) -> None:
        super().__init__(eta_u=1.0, eta_v=1.0)


class FedAlt(FedAvgP):
    """FedAlt (Pillutla et al. 2022): the first ``personal_steps`` local steps update v_i with u
    frozen, the remaining steps update u with v_i frozen; the server averages u as FedAvg-P.

    Args:
        personal_steps: steps of the personal phase, >= 0 (``None``: half of K, rounded down);
            with ``personal_steps >= K`` the shared tensors do not move.
        eta_u, eta_v: outer step sizes as in FedAvg-P.
    """

    def __init__(self, personal_steps: int | None = None, eta_u: float = 1.0, eta_v: float = 1.0) -> None:
        if personal_steps is not None and personal_steps < 0:
            raise ValueError(f"FedAlt personal_steps must be >= 0 (or null for K // 2), got {personal_steps}")
        super().__init__(eta_u=eta_u, eta_v=eta_v)
        self.personal_steps = personal_steps

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        k_v = ctx.num_steps // 2 if self.personal_steps is None else self.personal_steps
        personal_phase = ctx.step < k_v  # a schedule on the step index, not on data
        _, grad = ctx.grad(params)
        stepped = split_sgd_step(params, grad, ctx)
        return {k: stepped[k] if (k in ctx.personal) == personal_phase else p for k, p in params.items()}, local

"""FedLADA (Sun et al. 2023, local adaptive amended optimizer), the FAdam paper's baseline.

The server broadcasts the global update estimate g_a = -(x_t - x_{t-1}) / (K eta_l)
(0 in the first round); a client steps x_i <- x_i - eta_l (a Delta + (1 - a) g_a)
with Delta LocalAdam's direction (AMSGrad max, persistent v_i).

Rule: docs/algorithms.md, section 13, (13.1)-(13.2); a = 1 is LocalAdam (E7).
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, Payload, RoundInfo, mean_steps
from fl_lightning.algorithms.local_adam import LocalAdam
from fl_lightning.optim import tracked_adam_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedLADA(LocalAdam):
    """LocalAdam amended by the global update estimate.

    Args:
        global_lr, beta1, beta2, eps: as LocalAdam.
        a: weight of the local Adam direction, in [0, 1]; a = 1 is LocalAdam.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = True  # FedAvg's sum; g_a is the pseudo-gradient rescaled

    def __init__(
        self, global_lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-8, a: float = 0.5
    ) -> None:
        super().__init__(global_lr, beta1, beta2, eps)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"algorithm a (weight of the local Adam direction) must be in [0, 1], got {a}")
        self.a = float(a)

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {"g_a": P.zeros_like(x)}

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, "g_a": server_state["g_a"]}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        local = super().client_init(params, ctx)
        local["shift"] = P.scale(ctx.broadcast["g_a"], 1.0 - self.a)
        return local

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        shift = local["shift"]
        return tracked_adam_step(params, grad, local, ctx.lr, self.betas, self.eps, step_shift=shift, scale=self.a)

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """The server SGD step is x <- x - eta_g pseudo_grad, so g_a = eta_g pseudo_grad / (K eta_l)."""
        pseudo_grad, _ = super().aggregate_sum(x, sums, server_state, info, local_steps)
        g_a = P.scale(pseudo_grad, self.global_lr / (mean_steps(local_steps) * info.local_lr))
        return pseudo_grad, {**server_state, "g_a": g_a}

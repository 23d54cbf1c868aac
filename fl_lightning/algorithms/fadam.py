"""FAdamET and FAdamGT (Chen et al., "Parameter Tracking in Federated Learning with
Adaptive Optimization", Algorithm 1).

Both add a tracking correction y - y_i to LocalAdam: ET after the moment estimate
(line 17), GT to the gradient before it (line 12). Only the clients in Y_t ⊆ S_t
refresh y_i (lines 20-23) and upload y_i+ - y_i; the server sets
x <- x + eta_g mean_S(x_i - x) (line 28) and y <- y + (1/N) sum_Y (y_i+ - y_i) (line 29).

Rules: docs/algorithms.md, section 12: ET (12.2)-(12.3), GT (12.4)-(12.5), server (12.7);
checked properties E11; why ET stops short of the optimum and GT does not: section 19.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, Payload, RoundInfo
from fl_lightning.algorithms.local_adam import LocalAdam
from fl_lightning.algorithms.tracking import TrackingSubset
from fl_lightning.optim import tracked_adam_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class _TrackedAdam(LocalAdam):
    """Shared part: tracking state y_i (client) and y (server), the subset Y_t, the server update.

    ``mirrored_uploads``: y = mean_i y_i is kept by summing the uploaded y_i+ - y_i.

    Args:
        global_lr, beta1, beta2, eps: as LocalAdam.
        tracking: |Y_t|, an int count in [0, S] or a float fraction of S in [0, 1]
            (paper: Y = S/2, i.e. 0.5).
    """

    mirrored_uploads = ("y_delta",)

    def __init__(
        self,
        global_lr: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-8,
        tracking: int | float = 0.5,
    ) -> None:
        super().__init__(global_lr, beta1, beta2, eps)
        self.tracking = TrackingSubset(tracking, name="algorithm tracking")

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"v": P.zeros_like(x), "y": P.zeros_like(x)}

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {"y": P.zeros_like(x)}

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, "y": server_state["y"]}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        local = super().client_init(params, ctx)
        local["shift"] = P.sub(ctx.broadcast["y"], ctx.client_state["y"])  # y - y_i, constant in the round
        return local

    def tracking_update(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> TensorDict:
        """y_i+ (lines 21-22)."""
        raise NotImplementedError

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        upload, state = super().client_finish(params, local, ctx)
        if ctx.client_id in self.tracking.select(ctx.info.plan):
            y_new = self.tracking_update(params, local, ctx)
            upload["y_delta"] = P.sub(y_new, ctx.client_state["y"])
            state = {**state, "y": y_new}
        return upload, state

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate(x, uploads, weights, server_state, info, local_steps)
        y = server_state["y"]
        for upload in uploads:
            if "y_delta" in upload:
                y = P.add(y, upload["y_delta"], 1.0 / info.num_clients)
        return pseudo_grad, {**server_state, "y": y}


class FAdamET(_TrackedAdam):
    """Estimate tracking: x_i <- x_i - eta_l (Delta + y - y_i);  y_i+ = y_i - y + (x - x_i)/(K eta_l).

    Since x - x_i = eta_l sum_k (Delta_k + y - y_i), y_i+ is the mean Adam direction of the round.
    """

    elementwise = True

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        return tracked_adam_step(params, grad, local, ctx.lr, self.betas, self.eps, step_shift=local["shift"])

    def tracking_update(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> TensorDict:
        drift = P.scale(P.sub(ctx.broadcast["x"], params), 1.0 / (ctx.num_steps * ctx.lr))
        return P.sub(drift, local["shift"])


class FAdamGT(_TrackedAdam):
    """Gradient tracking: Adam on g_hat = g + y - y_i;  y_i+ = (1/K) sum_k g_k (raw gradients)."""

    elementwise = True

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        local = super().client_init(params, ctx)
        local["grad_sum"] = P.zeros_like(params)
        return local

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        params, local = tracked_adam_step(params, grad, local, ctx.lr, self.betas, self.eps, grad_shift=local["shift"])
        return params, {**local, "grad_sum": P.add(local["grad_sum"], grad)}

    def tracking_update(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> TensorDict:
        return P.scale(local["grad_sum"], 1.0 / ctx.num_steps)

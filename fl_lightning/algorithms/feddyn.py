"""FedDyn (Acar et al. 2021, Alg. 1): dynamic linear regularizer per client.

Rule: docs/algorithms.md, section 5, (5.1)-(5.4).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, weighted_sum_or_zeros
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedDyn(Algorithm):
    """Local loss f_i(w) - <l_i, w> + (alpha/2)||w - x||^2, i.e. gradient g - l_i + alpha (w - x).

    After training l_i <- l_i - alpha (w_i - x). Server: h <- h - alpha (1/N) sum_{i in S} (w_i - x);
    x <- sum_i w_i' w_i - h/alpha with the round's aggregation weights w_i'. The server
    update is exact only with global_lr = 1 (the default).

    Args:
        alpha: regularization strength, > 0.
        global_lr: server learning rate applied to the pseudo-gradient x - x_new.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = True  # sums of w_i delta_i and of delta_i / N
    upload_entries = ("delta",)
    mirrored_uploads = ("delta",)  # h = mean_i l_i (both move by alpha delta_i)

    def __init__(self, alpha: float = 0.01, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not alpha > 0:
            raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha = alpha

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"l": P.zeros_like(x)}

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {"h": P.zeros_like(x)}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        l_i, x = ctx.client_state["l"], ctx.broadcast["x"]
        direction = {k: grad[k] - l_i[k] + self.alpha * (params[k] - x[k]) for k in grad}
        return sgd_step(params, direction, ctx.lr), local

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        delta = P.sub(params, ctx.broadcast["x"])
        return {"delta": delta}, {"l": P.add(ctx.client_state["l"], delta, -self.alpha)}

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        deltas = P.part(uploads, "delta")
        mean = weighted_sum_or_zeros(deltas, [1.0 / info.num_clients] * len(deltas), x)
        return {"delta_over_n": mean, "delta": weighted_sum_or_zeros(deltas, weights, x)}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        h = P.add(server_state["h"], sums["delta_over_n"], -self.alpha)
        # x - x_new = -(sum_i w_i delta_i) + h / alpha
        pseudo_grad = P.add(P.scale(sums["delta"], -1.0), h, 1.0 / self.alpha)
        return pseudo_grad, {"h": h}

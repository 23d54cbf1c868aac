"""FedAvg (McMahan et al. 2017): K local SGD steps, server x <- x + eta_g * sum_i w_i (x_i - x).

Rule: docs/algorithms.md, section 2, (2.1)-(2.2).
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedAvg(Algorithm):
    """Local SGD; the aggregation weights w_i come from the round plan (uniform or by sample count)."""

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        return sgd_step(params, grad, ctx.lr), local

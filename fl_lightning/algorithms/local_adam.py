"""LocalAdam: K local AMSGrad-Adam steps per round, FedAvg aggregation.

Baseline of Chen et al. (FAdam paper), Algorithm 1 with y = 0: the first moment m
restarts at 0 every round, the second moment v_i is the client's own and persists
across the rounds it participates in (lines 8 and 24).

Rule: docs/algorithms.md, section 11, (11.1)-(11.4).
"""

from __future__ import annotations

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload
from fl_lightning.optim import adam_round_init, tracked_adam_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class LocalAdam(Algorithm):
    """Local Adam (AMSGrad max, no bias correction) with a per-client persistent v_i.

    Args:
        global_lr: server lr eta_g.
        beta1: first-moment decay, in [0, 1).
        beta2: second-moment decay, in [0, 1).
        eps: epsilon > 0 of the Adam denominator.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    upload_entries = ("delta",)

    def __init__(self, global_lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-8) -> None:
        super().__init__(global_lr)
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"algorithm {name} must be in [0, 1), got {beta}")
        if not eps > 0:
            raise ValueError(f"algorithm eps must be > 0, got {eps}")
        self.betas, self.eps = (float(beta1), float(beta2)), float(eps)

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"v": P.zeros_like(x)}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return adam_round_init(ctx.client_state["v"])

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        return tracked_adam_step(params, grad, local, ctx.lr, self.betas, self.eps)

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """Upload x_i - x; keep v_i <- v (line 24: the running v, not the max)."""
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {**ctx.client_state, "v": local["v"]}

"""FedProx (Li et al. 2020, Eq. 2): local objective f_i(w) + mu/2 ||w - x||^2.

Rule: docs/algorithms.md, section 3, (3.1)-(3.2); mu = 0 is FedAvg (E1).
"""

from __future__ import annotations

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedProx(Algorithm):
    """Client gradient g + mu (x_i - x); server as FedAvg.

    Args:
        mu: proximal coefficient, >= 0 (0 is FedAvg).
        global_lr: server learning rate.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)

    def __init__(self, mu: float = 0.01, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not mu >= 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.mu = mu

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        grad = P.add(grad, P.sub(params, ctx.broadcast["x"]), self.mu)
        return sgd_step(params, grad, ctx.lr), local

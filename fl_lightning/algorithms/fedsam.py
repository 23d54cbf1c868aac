"""FedSAM (Qu et al. 2022; SAM of Foret et al. 2021, Eq. 2-3 as the local optimizer).

Rule: docs/algorithms.md, section 6, (6.1)-(6.3); rho = 0 is FedAvg (E1).
"""

from __future__ import annotations

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.optim import sam_perturbation, sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedSAM(Algorithm):
    """e = rho g/||g||; the gradient is re-evaluated at x_i + e on the same minibatch; SGD step at x_i.

    Two gradients per local step. Server as FedAvg.

    Args:
        rho: perturbation radius, >= 0 (0 is FedAvg).
        global_lr: server learning rate.
    """

    def __init__(self, rho: float = 0.05, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not rho >= 0:
            raise ValueError(f"FedSAM rho must be >= 0, got {rho}")
        self.rho = rho

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        _, sharp_grad = ctx.grad(P.add(params, sam_perturbation(grad, self.rho)))
        return sgd_step(params, sharp_grad, ctx.lr), local

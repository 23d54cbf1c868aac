"""pFedMe (Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020,
Algorithm 1): each local step solves the Moreau-envelope inner problem
theta = argmin f_i(theta; batch) + lambda/2 ||theta - w_i||^2 approximately, then moves the local model
w_i towards theta; the server averages the local models with step beta.

Rule: docs/algorithms.md, section 25.4, (25.4.1)-(25.4.5); inner_steps = 0 leaves every model where it is,
lambda = 0 trains theta by plain local SGD and keeps w.
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step


class PFedMe(Algorithm):
    """Per local step k, on the step's minibatch xi_k: ``inner_steps`` (K_in) gradient steps
    theta <- theta - gamma_v (grad f_i(theta; xi_k) + lambda (theta - w_{i,k})), warm-started from the previous
    step's theta (theta = w^t at the round's start, as the authors' code), then
    w_{i,k+1} = w_{i,k} - eta_l lambda (w_{i,k} - theta). Upload w_{i,K} - w^t; server (FedAvg's aggregate with
    global_lr = beta): w <- w + beta sum_i p_i (w_{i,K} - w) = (1 - beta) w + beta sum_i p_i w_{i,K}.
    gamma_v = ``local.personal_lr`` (default ``local.lr``), eta_l = ``local.lr``. The client keeps and
    predicts with its last theta.

    Args:
        lam: lambda, the Moreau envelope's coefficient, >= 0 (15 in the paper).
        inner_steps: K_in, gradient steps of the inner problem per local step, >= 0 (5 in the paper).
        global_lr: beta, the server's step (1: the mean of the local models).
    """

    reads_personal_lr = True

    upload_entries = ("delta",)  # its client_finish uploads FedAvg's delta of the shared model only (DP noise covers it)

    elementwise = True

    def __init__(self, lam: float = 15.0, inner_steps: int = 5, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not lam >= 0:
            raise ValueError(f"PFedMe lam must be >= 0, got {lam}")
        if type(inner_steps) is not int or inner_steps < 0:
            raise ValueError(f"PFedMe inner_steps must be an integer >= 0, got {inner_steps!r}")
        self.lam, self.inner_steps = lam, inner_steps

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"theta": P.detach_clone(x)}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"theta": params}  # theta starts the round at the broadcast w^t

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        theta = local["theta"]
        for _ in range(self.inner_steps):  # ctx.grad: the same minibatch at every call of this step
            _, grad = ctx.grad(theta)
            theta = sgd_step(theta, P.add(grad, P.sub(theta, params), self.lam), ctx.personal_lr)
        return sgd_step(params, P.sub(params, theta), ctx.lr * self.lam), {"theta": theta}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {"theta": local["theta"]}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        return {**x, **client_state["theta"]}

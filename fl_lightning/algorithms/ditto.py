"""Ditto (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021, Algorithm 1): FedAvg on the global model w, and per client a personal model v_i trained on the
same minibatches towards w by the proximal objective F_i(v) + lambda/2 ||v - w||^2.

Rule: docs/algorithms.md, section 25.3, (25.3.1)-(25.3.4); lambda = 0 makes v_i the purely local model, and
the global model is FedAvg's bit for bit for any lambda (same uploads).
"""

from __future__ import annotations

from fl_lightning.algorithms.base import ClientContext, Payload
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step


class Ditto(FedAvg):
    """Per local step k, on the step's minibatch: w_{i,k+1} = w_{i,k} - eta_l grad F_i(w_{i,k}) (FedAvg, uploaded),
    v_{k+1} = v_k - gamma_v (grad F_i(v_k) + lambda (v_k - w^t)) (kept; w^t the round's broadcast);
    gamma_v = ``local.personal_lr`` (default ``local.lr``). The client predicts with v_i.

    v_i is initialised to the global model broadcast in the round the client is first selected (the
    paper's v_i = w^0 for clients present from round 0; an unseen client starts from the current w).

    Args:
        lam: lambda, the proximal coefficient pulling v_i to the global model, >= 0 (0: local training only).
        global_lr: server learning rate (FedAvg's).
    """

    reads_personal_lr = True

    upload_entries = ("delta",)  # its client_finish uploads FedAvg's delta of the shared model only (DP noise covers it)

    elementwise = True

    def __init__(self, lam: float = 0.1, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not lam >= 0:
            raise ValueError(f"Ditto lam must be >= 0, got {lam}")
        self.lam = lam

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"v": P.detach_clone(x)}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"v": ctx.client_state["v"]}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)  # first: the global path's loss is the step's reported one, as FedAvg's
        v = local["v"]
        _, grad_v = ctx.grad(v)  # the same minibatch
        direction = P.add(grad_v, P.sub(v, ctx.broadcast["x"]), self.lam)
        return sgd_step(params, grad, ctx.lr), {"v": sgd_step(v, direction, ctx.personal_lr)}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {"v": local["v"]}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        return {**x, **client_state["v"]}

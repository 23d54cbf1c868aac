"""APFL, adaptive personalized federated learning (Deng, Kamani & Mahdavi, arXiv:2003.13461, 2020).

Algorithm 1 with the adaptive mixing weight of Sec. 3 (the gradient step on alpha_i).
Rule: docs/algorithms.md, section 25.5, (25.5.1)-(25.5.5); alpha = 0 (non-adaptive) is FedAvg.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step


class APFL(Algorithm):
    """Each client keeps a personal model v_i and a mixing weight alpha_i (client state); per local step,
    on the step's minibatch and from the iterates before the step (w_k, v_k, alpha_k):
    w <- w - eta grad f(w);  v <- v - eta alpha grad f(vbar), vbar = alpha v + (1 - alpha) w;
    with ``adaptive_alpha``: alpha <- clip(alpha - eta_alpha <v - w, grad f(vbar)>, 0, 1).
    Uploads w_i - x (FedAvg's server); predicts with alpha_i v_i + (1 - alpha_i) x.

    Args:
        alpha: the initial mixing weight alpha_i^0 in [0, 1].
        adaptive_alpha: whether alpha_i is learned (Sec. 3) or stays ``alpha``.
        alpha_lr: eta_alpha, the step size of alpha_i (> 0; ``None``: the local lr eta, as the paper).
        global_lr: server learning rate.
    """

    upload_entries = ("delta",)  # its client_finish uploads FedAvg's delta of the shared model only (DP noise covers it)

    # not elementwise: the alpha update's inner product is a reduction (batched execution runs it per client under vmap)

    def __init__(self, alpha: float = 0.5, adaptive_alpha: bool = True, alpha_lr: float | None = None, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not 0 <= alpha <= 1:
            raise ValueError(f"APFL alpha must be in [0, 1], got {alpha}")
        if type(adaptive_alpha) is not bool:
            raise ValueError(f"APFL adaptive_alpha must be true or false, got {adaptive_alpha!r}")
        if alpha_lr is not None and not alpha_lr > 0:
            raise ValueError(f"APFL alpha_lr must be > 0 (or null for the local lr), got {alpha_lr}")
        self.alpha, self.adaptive_alpha, self.alpha_lr = alpha, adaptive_alpha, alpha_lr

    def client_state_init(self, x: TensorDict) -> NestedState:
        first = next(iter(x.values()))
        return {"v": P.detach_clone(x), "alpha": {"alpha": torch.tensor(self.alpha, dtype=first.dtype, device=first.device)}}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"v": ctx.client_state["v"], "alpha": ctx.client_state["alpha"]["alpha"]}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        v, alpha = local["v"], local["alpha"]
        _, grad_w = ctx.grad(params)  # (25.5.1) first: the step's reported loss is the shared model's
        vbar = mix(v, params, alpha)
        _, grad_vbar = ctx.grad(vbar)
        new_v = {k: v[k] - ctx.lr * (alpha * grad_vbar[k]) for k in v}  # (25.5.2): grad_v f(vbar) = alpha grad f(vbar)
        if self.adaptive_alpha:  # (25.5.3): d/d alpha f(alpha v + (1 - alpha) w) = <v - w, grad f(vbar)>
            lr_alpha = ctx.lr if self.alpha_lr is None else self.alpha_lr
            slope = sum(((v[k] - params[k]) * grad_vbar[k]).sum() for k in v)
            alpha = (alpha - lr_alpha * slope).clamp(0.0, 1.0).to(alpha.dtype)  # compiled: lr is a float64 0-dim tensor
        return sgd_step(params, grad_w, ctx.lr), {"v": new_v, "alpha": alpha}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {"v": local["v"], "alpha": {"alpha": local["alpha"]}}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        """(25.5.5) vbar_i = alpha_i v_i + (1 - alpha_i) x with x the global model at evaluation."""
        return mix(client_state["v"], x, client_state["alpha"]["alpha"])


def mix(v: TensorDict, w: TensorDict, alpha: torch.Tensor) -> TensorDict:
    """alpha v + (1 - alpha) w, per tensor."""
    return {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}

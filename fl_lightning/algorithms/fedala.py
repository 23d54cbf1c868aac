"""FedALA: adaptive local aggregation (Zhang, Hua, Wang, Song, Xue, Ma & Guan, AAAI 2023, Algorithm 1, Eqs. 3-6).

Rule: docs/algorithms.md, section 25.11, (25.11.1)-(25.11.5). Each client keeps its local model
theta_i and element-wise aggregation weights W_i (over the top ``layer_idx`` tensors). At the start of
its round it mixes the global model into its own, theta_hat = theta_i + (x - theta_i) * W_i on the top
tensors (the global values below), learning W_i by ``ala_steps`` projected gradient steps on its whole
training set; it then trains theta_hat by K SGD steps and uploads theta_i' - x (FedAvg's server).
"""

from __future__ import annotations

import torch

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedALA(Algorithm):
    """Adaptive local aggregation, then local SGD from the aggregate; FedAvg's server.

    Client state: ``model`` (theta_i, the model the client ended its last round with; the initial
    global model before its first) and ``weights`` (W_i, one tensor per top tensor, initially ones).
    Clients predict with theta_i.

    Args:
        layer_idx: p, how many of the model's last parameter tensors are aggregated adaptively (>= 1;
            the paper's and PFLlib's default 2: the head's weight and bias); the others take x.
        eta: step size eta of the weight learning, > 0 (PFLlib's default 1.0).
        ala_steps: gradient steps on W_i per round, >= 0, each on the full-batch gradient of the client's
            whole training set (the paper: minibatches of a random ``rand_percent`` = 80% share, until
            convergence in the client's first adaptive round, one pass afterwards). 0: theta_hat with the
            stored W_i, no learning.
        global_lr: server learning rate.
    """

    upload_entries = ("delta",)  # its client_finish uploads FedAvg's delta of the shared model only (DP noise covers it)

    def __init__(self, layer_idx: int = 2, eta: float = 1.0, ala_steps: int = 5, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if type(layer_idx) is not int or layer_idx < 1:
            raise ValueError(f"FedALA layer_idx must be an integer >= 1, got {layer_idx!r}")
        if not eta > 0:
            raise ValueError(f"FedALA eta must be > 0, got {eta}")
        if type(ala_steps) is not int or ala_steps < 0:
            raise ValueError(f"FedALA ala_steps must be an integer >= 0, got {ala_steps!r}")
        self.layer_idx, self.eta, self.ala_steps = layer_idx, eta, ala_steps

    def _top(self, x: TensorDict) -> list[str]:
        """The names of the last ``layer_idx`` tensors (all of them for a model with fewer)."""
        return list(x)[-self.layer_idx :]

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"model": P.detach_clone(x), "weights": {k: torch.ones_like(x[k]) for k in self._top(x)}}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        """(25.11.1)-(25.11.3): theta_hat and the learned W_i, before local training."""
        x, theta, weights = ctx.broadcast["x"], ctx.client_state["model"], dict(ctx.client_state["weights"])
        top = list(weights)
        gap = {k: x[k] - theta[k] for k in top}  # x - theta_i on the top tensors

        def mix(w: TensorDict) -> TensorDict:  # lower tensors: x; top: theta_i + (x - theta_i) * W_i
            return {**x, **{k: theta[k] + gap[k] * w[k] for k in top}}

        for _ in range(self.ala_steps):
            grad = ctx.full_grad(mix(weights))  # the gradient of the client's loss on its whole training set at theta_hat
            weights = {k: (w - self.eta * grad[k] * gap[k]).clamp(0.0, 1.0) for k, w in weights.items()}
        return {"model": mix(weights), "weights": weights}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        """(25.11.4): SGD on the client's model from theta_hat (the broadcast x in ``params`` is not trained)."""
        _, grad = ctx.grad(local["model"])
        return params, {"model": sgd_step(local["model"], grad, ctx.lr), "weights": local["weights"]}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """(25.11.5): upload theta_i' - x; keep theta_i' and W_i."""
        return {"delta": P.sub(local["model"], ctx.broadcast["x"])}, {"model": local["model"], "weights": local["weights"]}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        return {**x, **client_state["model"]}

"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), Algorithm 1 with its first-order (FO) and
Hessian-free (HF) variants.

Rule: docs/algorithms.md, section 25.6, (25.6.1)-(25.6.4); alpha = 0 (FO) is FedAvg.
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step

VARIANTS = ("fo", "hf")


class PerFedAvg(Algorithm):
    """Local steps on the MAML objective f_i(w - alpha grad f_i(w)), on the step's minibatch D (used as
    the paper's D, D' and D''): temp = w - alpha grad f(w);
    FO: w <- w - beta grad f(temp);  HF: w <- w - beta (grad f(temp) - alpha H(w) grad f(temp)), the
    Hessian-vector product by central differences of gradients. beta = ``local.lr``. Uploads w_i - x
    (FedAvg's server); every client (trained or unseen) predicts with x - alpha grad f_i(x) on one of its
    training batches (``personalize_steps = 1``).

    Args:
        alpha: the inner (adaptation) step size, >= 0.
        variant: ``fo`` (first order) or ``hf`` (Hessian-free).
        delta: the finite-difference step of HF's Hessian-vector product, > 0.
        global_lr: server learning rate.
    """

    elementwise = True  # every operation is per entry (no norms or sums over a tensor)
    personalize_steps = 1

    def __init__(self, alpha: float = 0.01, variant: str = "fo", delta: float = 1e-3, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not alpha >= 0:
            raise ValueError(f"PerFedAvg alpha must be >= 0, got {alpha}")
        if variant not in VARIANTS:
            raise ValueError(f"PerFedAvg variant must be one of {list(VARIANTS)}, got {variant!r}")
        if not delta > 0:
            raise ValueError(f"PerFedAvg delta must be > 0, got {delta}")
        self.alpha, self.variant, self.delta = alpha, variant, delta

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)  # first: the step's reported loss is the model's at w
        temp = sgd_step(params, grad, self.alpha)  # (25.6.1)
        _, direction = ctx.grad(temp)  # grad f(temp; D')
        if self.variant == "hf":  # (25.6.3): d - alpha H(w; D'') d, H d = (grad f(w + delta d) - grad f(w - delta d)) / (2 delta)
            _, ahead = ctx.grad(P.add(params, direction, self.delta))
            _, behind = ctx.grad(P.add(params, direction, -self.delta))
            direction = {k: d - self.alpha * ((ahead[k] - behind[k]) / (2 * self.delta)) for k, d in direction.items()}
        return sgd_step(params, direction, ctx.lr), local  # (25.6.2) / (25.6.3)

    def personalize_step(self, params: TensorDict, ctx: ClientContext) -> TensorDict:
        """(25.6.4) one SGD step with step size alpha on one of the client's training batches."""
        _, grad = ctx.grad(params)
        return sgd_step(params, grad, self.alpha)

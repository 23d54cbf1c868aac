"""SVRG (Johnson & Zhang 2013) on tensor dicts: the variance-reduced direction and step (docs/algorithms.md, (10.3))."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.core.params import TensorDict


def svrg_direction(grad: TensorDict, snapshot_grad: TensorDict, full_grad: TensorDict) -> TensorDict:
    """v = grad_#(w) - grad_#(w~) + mu~: both minibatch gradients on the same sample #,
    mu~ the full local gradient at the snapshot w~ (Rostami & Kia, Alg. 1 line 15)."""
    return {k: g - snapshot_grad[k] + full_grad[k] for k, g in grad.items()}


def svrg_step(
    params: TensorDict, grad: TensorDict, snapshot_grad: TensorDict, full_grad: TensorDict, lr: float | Tensor
) -> TensorDict:
    """w <- w - lr * v (Alg. 1 line 14)."""
    v = svrg_direction(grad, snapshot_grad, full_grad)
    return {k: p - lr * v[k] for k, p in params.items()}

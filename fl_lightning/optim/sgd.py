"""Plain SGD on tensor dicts."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.params import TensorDict


def sgd_step(params: TensorDict, direction: TensorDict, lr: float | Tensor) -> TensorDict:
    """x <- x - lr * direction, for every tensor of the dict.

    Kept as plain ``p - lr * d`` (no fused foreach kernel): the exact reductions
    between algorithms (FedMIM/FedCM/FedProx to FedAvg) are bitwise only if every
    rule rounds the same way.
    """
    return {k: p - lr * direction[k] for k, p in params.items()}

"""Binary logistic regression on features split into a shared and a personal part.

The model of Sec. 5 of Chen, Cao, Yuan & Wen 2023, arXiv:2309.17409 (docs/algorithms.md, section 14): for a sample with
shared features a, personal features b and label c in {-1, +1},
f = log(1 + exp(-c (a^T u + b^T v))) + rho (|u|^2/(1+|u|^2) + |v|^2/(1+|v|^2)).
Mark ``v`` personal (``personal: [v]``) to give every client its own v_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class PenalizedLogits:
    """Model output: ``logits`` plus a parameter ``penalty`` that the objective (``fl_lightning/core/objective.py``) adds to the loss."""

    logits: Tensor
    penalty: Tensor


def nonconvex_penalty(w: Tensor) -> Tensor:
    """|w|^2 / (1 + |w|^2), the non-convex regulariser of the paper's experiment."""
    sq = (w * w).sum()
    return sq / (1 + sq)


class SplitLogistic(nn.Module):
    """Score s = a^T u + b^T v with a the first ``shared_features`` flattened inputs, b the rest.

    Outputs logits ``[0, s]``: cross-entropy with label y in {0, 1} is then exactly
    log(1 + exp(-c s)) with c = 2y - 1, and argmax gives the predicted class.

    Args:
        in_features: flattened input size d_u + d_v (64 for 8x8 digits, 784 for MNIST).
        shared_features: d_u, in [1, in_features).
        rho: weight of the non-convex regulariser, >= 0.
    """

    def __init__(self, in_features: int = 64, shared_features: int = 32, rho: float = 0.01) -> None:
        super().__init__()
        if not 1 <= shared_features < in_features:
            raise ValueError(f"shared_features must be in [1, in_features={in_features}), got {shared_features}")
        if not rho >= 0:
            raise ValueError(f"rho must be >= 0, got {rho}")
        self.shared_features, self.rho = shared_features, rho
        self.u = nn.Parameter(torch.zeros(shared_features))
        self.v = nn.Parameter(torch.zeros(in_features - shared_features))

    def forward(self, x: Tensor) -> PenalizedLogits:
        x = x.flatten(1)
        score = x[:, : self.shared_features] @ self.u + x[:, self.shared_features :] @ self.v
        logits = torch.stack([torch.zeros_like(score), score], dim=-1)
        return PenalizedLogits(logits, self.rho * (nonconvex_penalty(self.u) + nonconvex_penalty(self.v)))

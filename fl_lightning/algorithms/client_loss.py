"""A client's loss at the broadcast model over its whole training set, F_k(w^t): what the fairness rules weigh
clients by (docs/algorithms.md, section 30)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext


def loss_at_broadcast(ctx: ClientContext) -> Tensor:
    """F_k(w^t): the mean cross-entropy of the broadcast model over the client's training samples (a data pass;
    padded rows, where clients run stacked, are masked out), in float64."""
    seen = ctx.data_pass(ctx.broadcast["x"])
    losses = torch.nn.functional.cross_entropy(seen.logits, seen.target, reduction="none")
    return ((losses * seen.mask).sum() / seen.mask.sum()).double()

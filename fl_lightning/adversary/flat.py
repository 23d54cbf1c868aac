"""An upload's norm over its flat vector (``fl_lightning.core.flat``): model poisoning acts on every tensor a client sends."""

from __future__ import annotations

import torch

from fl_lightning.core.flat import flatten, unflatten
from fl_lightning.core.tasks import Payload

__all__ = ["flatten", "norm", "unflatten"]


def norm(upload: Payload) -> float:
    """||u||: the L2 norm over every tensor of every entry."""
    return float(torch.linalg.vector_norm(flatten(upload)))

"""Uploads as flat float64 vectors and back: model poisoning acts on every tensor a client sends."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.core.tasks import Payload


def flatten(upload: Payload) -> Tensor:
    """Every tensor of every entry, in the upload's order, as one float64 vector."""
    return torch.cat([t.detach().reshape(-1).double() for td in upload.values() for t in td.values()])


def unflatten(vector: Tensor, like: Payload) -> Payload:
    """``vector`` cut into ``like``'s entries, shapes, dtypes and devices."""
    out, at = {}, 0
    for name, td in like.items():
        out[name] = {}
        for key, t in td.items():
            out[name][key] = vector[at : at + t.numel()].view(t.shape).to(t.device, t.dtype)
            at += t.numel()
    return out


def norm(upload: Payload) -> float:
    """||u||: the L2 norm over every tensor of every entry."""
    return float(torch.linalg.vector_norm(flatten(upload)))

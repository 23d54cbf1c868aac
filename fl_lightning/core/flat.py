"""Payloads (an upload's entries of tensor dicts) as one flat vector and back: what reads or writes every tensor a
client sends at once (a model-poisoning attack, secure aggregation's encoding, a noise vector added to a sum)."""

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
            out[name][key] = vector[at : at + t.numel()].reshape(t.shape).to(t.device, t.dtype)
            at += t.numel()
    return out

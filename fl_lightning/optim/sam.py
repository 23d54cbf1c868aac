"""Sharpness-aware perturbation (Foret et al. 2021, Eq. 2) on tensor dicts: docs/algorithms.md, (6.1)."""

from __future__ import annotations

import torch

from fl_lightning.core.params import TensorDict

_EPS = 1e-12  # keeps rho = 0 exact (0 * g / eps = 0) when the gradient vanishes


def sam_perturbation(grads: TensorDict, rho: float) -> TensorDict:
    """e = rho * g / ||g||, with ||g|| the Euclidean norm over all tensors of the dict."""
    norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
    factor = rho / (norm + _EPS)
    return {k: g * factor for k, g in grads.items()}

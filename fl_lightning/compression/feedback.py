"""Error feedback (Stich et al. 2018; Karimireddy et al. 2019), docs/algorithms.md (21.6):

    p = x + e,   sent = C(p),   e' = p - sent,

so sent + e' = x + e: what the compressor dropped is added to the next message.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.compression.base import Compressor, Encoded


def error_feedback(compressor: Compressor, x: Tensor, residual: Tensor | None, generator: torch.Generator | None = None) -> tuple[Encoded, Tensor]:
    """The encoded message of ``x + residual`` and the new residual (``residual=None``: zero)."""
    corrected = x if residual is None else x + residual
    sent = compressor(corrected, generator)
    return sent, corrected - sent.value

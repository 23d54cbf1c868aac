"""Error feedback (Stich et al. 2018; Karimireddy et al. 2019), docs/algorithms.md (24.6):

    p = x + e,   sent = C'(p),   e' = p - sent,

so sent + e' = x + e: what the compressor dropped is added to the next message. Error feedback
needs a contractive C' (E||C'(p) - p||^2 <= (1 - delta) ||p||^2); an unbiased compressor with
variance omega (QSGD, scaled random-k) is made one as C' = C / (1 + omega) (Stich and Karimireddy
2020): without it the residual of a high-variance compressor grows without bound.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.compression.base import Compressor, Encoded


def contractive(compressor: Compressor, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
    """C'(x): the compressor's output, divided by 1 + omega for an unbiased compressor (same bytes)."""
    sent = compressor(x, generator)
    omega = compressor.variance(x.numel()) if compressor.unbiased else 0.0
    return Encoded(sent.value / (1 + omega), sent.nbytes) if omega > 0 else sent


def error_feedback(compressor: Compressor, x: Tensor, residual: Tensor | None, generator: torch.Generator | None = None) -> tuple[Encoded, Tensor]:
    """The encoded message of ``x + residual`` (``contractive``) and the new residual (``residual=None``: zero)."""
    corrected = x if residual is None else x + residual
    sent = contractive(compressor, corrected, generator)
    return sent, corrected - sent.value


def uplink_feedback(setting: bool | None, compressor: Compressor) -> bool:
    """Whether the uplink uses error feedback (24.6). ``setting=None`` (the default, "auto"): on for a
    biased compressor, whose dropped part only the residual returns; off for an unbiased one (QSGD,
    ``RandomK(unbiased=True)``), whose C(u) is right in expectation and which error feedback would send
    as C/(1 + omega), a step 1 + omega times smaller. ``True``/``False``: as given."""
    return (not compressor.unbiased) if setting is None else bool(setting)


def shrink_factors(compressor: Compressor, sizes: dict[str, int]) -> dict[str, float]:
    """1 + omega of (24.6) for each message tensor ``{name: numel}``: the factor error feedback divides an
    unbiased compressor's output by (1.0 for every tensor of a biased compressor)."""
    return {name: 1.0 + (compressor.variance(numel) if compressor.unbiased else 0.0) for name, numel in sizes.items()}

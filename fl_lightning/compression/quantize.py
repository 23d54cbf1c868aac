"""Quantizers: QSGD (Alistarh et al., NeurIPS 2017), scaled sign (Karimireddy et al., ICML 2019),
8-bit with a per-tensor scale, and fp16/bf16 casts.

Encodings and bits per coordinate: docs/algorithms.md, (24.2)-(24.5).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.compression.base import SCALE_BYTES, Compressor, Encoded, compute_dtype, field_bits, packed_bytes


class QSGD(Compressor):
    """(24.2) Q_s(v)_i = ||v||_2 sign(v_i) xi_i / s with xi_i = l + Bernoulli(s|v_i|/||v||_2 - l),
    l = floor(s|v_i|/||v||_2): unbiased. Sent: the norm (float32), per coordinate a sign bit and
    the level xi_i in {0..s} as a fixed-width field of ceil(log2(s+1)) bits."""

    unbiased = True
    randomized = True

    def __init__(self, levels: int = 1) -> None:
        if isinstance(levels, bool) or int(levels) != levels or levels < 1:
            raise ValueError(f"QSGD.levels (s) must be an integer >= 1, got {levels}")
        self.levels = int(levels)

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        s, v = self.levels, x.to(compute_dtype(x))
        norm = torch.linalg.vector_norm(v)
        ratio = (v.abs() * (s / norm)).clamp_(max=s) if float(norm) > 0 else torch.zeros_like(v)  # <= s despite rounding
        lower = ratio.floor()
        u = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
        level = lower + (u < ratio - lower).to(v.dtype)
        value = (norm / s) * torch.sign(v) * level
        bits = 1 + field_bits(s + 1)
        return Encoded(value.to(x.dtype), SCALE_BYTES + packed_bytes(x.numel(), bits))

    def variance(self, numel: int) -> float:
        """min(d/s^2, sqrt(d)/s) (Alistarh et al. 2017, Lemma 3.1)."""
        return min(numel / self.levels**2, numel**0.5 / self.levels)

    def describe(self) -> str:
        return f"QSGD(levels={self.levels})"


class ScaledSign(Compressor):
    """(24.3) C(v) = (||v||_1 / d) sign(v), sign(0) = +1 (one bit per coordinate) and the scale as float32.
    Biased: use it with error feedback (EF-SignSGD). ||C(v)||_2 = ||v||_1 / sqrt(d) <= ||v||_2."""

    never_increases_norm = True

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        v = x.to(compute_dtype(x))
        scale = v.abs().sum() / v.numel()
        value = torch.where(v >= 0, scale, -scale)
        return Encoded(value.to(x.dtype), SCALE_BYTES + packed_bytes(x.numel(), 1))


class Int8(Compressor):
    """(24.4) Symmetric 8-bit: q_i = round(v_i / a) in [-127, 127] with a = max|v| / 127 (float32);
    decoded q_i a. Deterministic rounding to nearest (biased by at most a/2 per coordinate)."""

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        v = x.to(compute_dtype(x))
        scale = v.abs().max() / 127 if v.numel() else v.new_zeros(())
        q = (v / scale).round().clamp(-127, 127) if float(scale) > 0 else torch.zeros_like(v)
        return Encoded((q * scale).to(x.dtype), SCALE_BYTES + x.numel())


class Cast(Compressor):
    """(24.5) The tensor cast to ``float16`` or ``bfloat16`` (round to nearest even) and back: 2 bytes per coordinate."""

    DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

    def __init__(self, dtype: str = "bfloat16") -> None:
        if dtype not in self.DTYPES:
            raise ValueError(f"Cast.dtype must be one of {sorted(self.DTYPES)}, got {dtype!r}")
        self.dtype = dtype

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        target = self.DTYPES[self.dtype]
        return Encoded(x.to(target).to(x.dtype), x.numel() * torch.empty((), dtype=target).element_size())

    def describe(self) -> str:
        return f"Cast({self.dtype})"

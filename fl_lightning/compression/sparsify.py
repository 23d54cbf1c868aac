"""Top-k and random-k sparsification (Stich, Cordonnier, Jaggi, NeurIPS 2018).

Encoding (docs/algorithms.md, (24.1)): the k kept values in the tensor's dtype, plus their
positions as k indices of ceil(log2 d) bits or as a d-bit bitmap, whichever is smaller.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.compression.base import Compressor, Encoded, field_bits, packed_bytes


def sparse_bytes(numel: int, k: int, value_bytes: int) -> int:
    """(24.1): k values plus min(k indices of ceil(log2 d) bits, a d-bit bitmap)."""
    positions = min(packed_bytes(k, field_bits(numel)), packed_bytes(numel, 1))
    return k * value_bytes + positions


class _Sparsifier(Compressor):
    """Keeps k entries of each tensor: ``k`` entries, or ``ratio`` of them (k = ceil(ratio * d))."""

    never_increases_norm = True  # a subset of the entries (random-k with ``unbiased`` scales them up: not)

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        name = type(self).__name__
        if (ratio is None) == (k is None):
            raise ValueError(f"{name} takes exactly one of ratio (in (0, 1]) or k (>= 1), got ratio={ratio}, k={k}")
        if ratio is not None and not 0 < ratio <= 1:
            raise ValueError(f"{name}.ratio must be in (0, 1], got {ratio}")
        if k is not None and (isinstance(k, bool) or int(k) != k or k < 1):
            raise ValueError(f"{name}.k must be an integer >= 1, got {k}")
        self.ratio, self.k = ratio, None if k is None else int(k)

    def kept(self, numel: int) -> int:
        """k for a tensor of ``numel`` entries."""
        return self.k if self.k is not None else max(1, math.ceil(self.ratio * numel))

    def check_size(self, numel: int, where: str) -> None:
        if self.k is not None and self.k > numel:
            raise ValueError(f"{type(self).__name__}.k must be <= the size of every tensor it compresses, got k={self.k} for {where} of {numel} entries")

    def describe(self) -> str:
        return f"{type(self).__name__}({'k=%d' % self.k if self.k is not None else 'ratio=%g' % self.ratio})"

    def _keep(self, x: Tensor, index: Tensor, scale: float = 1.0) -> Encoded:
        flat = x.reshape(-1)
        values = flat[index] if scale == 1.0 else flat[index] * scale
        out = torch.zeros_like(flat).index_put_((index,), values)
        return Encoded(out.reshape(x.shape), sparse_bytes(flat.numel(), index.numel(), x.element_size()))


class TopK(_Sparsifier):
    """The k entries of largest magnitude (biased: use it with error feedback)."""

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        self.check_size(x.numel(), "a tensor")
        return self._keep(x, torch.topk(x.reshape(-1).abs(), self.kept(x.numel()), sorted=False).indices)


class RandomK(_Sparsifier):
    """k entries drawn uniformly without replacement; ``unbiased=True`` scales them by d/k
    (E[value] = x), else they are sent as they are (biased; the form used with error feedback)."""

    randomized = True

    def __init__(self, ratio: float | None = None, k: int | None = None, unbiased: bool = False) -> None:
        super().__init__(ratio, k)
        self.unbiased = bool(unbiased)
        self.never_increases_norm = not self.unbiased

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        self.check_size(x.numel(), "a tensor")
        d = x.numel()
        k = self.kept(d)
        index = torch.randperm(d, generator=generator, device=x.device)[:k]
        return self._keep(x, index, d / k if self.unbiased else 1.0)

    def variance(self, numel: int) -> float:
        """d/k - 1 when scaled (each entry x_i d/k with probability k/d)."""
        return numel / self.kept(numel) - 1 if self.unbiased else 0.0

    def describe(self) -> str:
        return super().describe()[:-1] + (", unbiased)" if self.unbiased else ")")

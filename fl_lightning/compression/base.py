"""The compressor contract: a tensor in, what the receiver decodes and the encoded size out.

A compressor is a pure function of its input and (for the randomized ones) a
``torch.Generator``: ``compressor(x, generator) -> Encoded(value, nbytes)``. ``value`` is the
tensor the receiver reconstructs (same shape and dtype as ``x``), ``nbytes`` the exact size of
the encoding stated in docs/algorithms.md, section 24 (shapes and dtypes are known to both sides:
no header is counted). Nothing is packed for real: the simulation sends ``value`` and counts
``nbytes``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

SCALE_BYTES = 4
"""A per-tensor scale or norm travels as one float32."""


class Encoded(NamedTuple):
    """A compressed tensor: what the receiver decodes, and the encoding's size in bytes."""

    value: Tensor
    nbytes: int


class Compressor:
    """Base class of compressors (``__call__`` maps a tensor to an ``Encoded``).

    Class attributes say what a caller may rely on: ``unbiased`` (E[value] = x over the
    generator's draws), ``randomized`` (it reads the generator).
    """

    unbiased: bool = False
    randomized: bool = False
    #: ||C(v)||_2 <= ||v||_2 for every v: a clipped upload stays clipped (client-level privacy's sensitivity).
    never_increases_norm: bool = False

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        raise NotImplementedError

    def variance(self, numel: int) -> float:
        """omega of an unbiased compressor on ``numel`` entries: E||C(v) - v||^2 <= omega ||v||^2 (0: exact)."""
        return 0.0

    def check_size(self, numel: int, where: str) -> None:
        """Raise ``ValueError`` (one line) if this compressor cannot encode a tensor of ``numel`` entries."""

    def describe(self) -> str:
        return type(self).__name__


class Identity(Compressor):
    """No compression: the tensor as it is, ``numel * element_size`` bytes."""

    unbiased = True
    never_increases_norm = True

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Encoded:
        return Encoded(x, x.numel() * x.element_size())


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` fields of ``bits`` bits each, packed end to end."""
    return math.ceil(count * bits / 8)


def field_bits(values: int) -> int:
    """Bits of a fixed-width field that can hold ``values`` distinct values (at least 1)."""
    return max(1, math.ceil(math.log2(values))) if values > 1 else 1


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32, or float64 for float64 tensors: the precision compressors compute in."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32

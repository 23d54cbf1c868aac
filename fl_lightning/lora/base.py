"""The contract of a federated LoRA aggregation (docs/algorithms.md, section 28).

A method sees, for one adapted layer, the factors every reporting client ends its round with
(A_i ``[r_i, in]``, B_i ``[out, r_i]``, each at the client's own rank r_i) and their aggregation
weights w_i (summing to 1), and returns a ``LayerUpdate``: the server's new factors at the global
rank r (``None``: keep the algorithm's server step of the factors, FedIT's mean) and a ``fold``,
the ``[out, in]`` matrix added to the frozen base weight in units of B A (the layer's LoRA scaling
alpha/r is applied by the caller). One small file per method shows only its rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LayerRound:
    """What a method may use besides the factors: the global rank r and a generator (fixed by seed and round)."""

    rank: int
    generator: torch.Generator | None = None


@dataclass
class LayerUpdate:
    """The server's result for one layer: new global factors (``None``: the algorithm's step of the factor
    means stands) and the matrix folded into the frozen weight (``None``: nothing), in units of B A."""

    a: Tensor | None = None
    b: Tensor | None = None
    fold: Tensor | None = None


class LoRAAggregation:
    """Base class of the methods. ``name`` is the setting's value; the flags say what the method needs.

    Args:
        ranks: each client's LoRA rank (heterogeneous ranks, docs/algorithms.md (28.7)): a list whose
            entry ``c % len(ranks)`` is client c's rank, each in [1, the model's rank]; ``None``: every
            client trains at the model's rank.
        tiers: instead of ``ranks``, the ranks a client may have, each client's drawn uniformly and once
            from ``seed`` and its id (``derive_seed(seed, c)``): the same on every process and resume.
        seed: the draw of ``tiers``.
    """

    name = "factors"
    #: Whether the method reads each client's factors (not only the algorithm's mean of them).
    needs_clients = True
    #: Whether the frozen base weights change (exported as adapter + the folded base).
    folds = False
    #: Whether the result has a client-level DP guarantee when the uploads are clipped and noised.
    private = False
    #: Whether each client keeps its B as a personal tensor (``model.personal``) instead of sending it.
    personal_b = False

    def __init__(self, ranks: Sequence[int] | None = None, tiers: Sequence[int] | None = None, seed: int = 0) -> None:
        if ranks is not None and tiers is not None:
            raise ValueError("lora_aggregation: set ranks (by client id) or tiers (drawn by seed), not both")
        for setting, values in (("ranks", ranks), ("tiers", tiers)):
            if values is not None and (not list(values) or min(int(r) for r in values) < 1):
                raise ValueError(f"lora_aggregation {setting} must be a non-empty list of ranks >= 1, got {list(values)}")
        self.ranks = [int(r) for r in ranks] if ranks is not None else None
        self.tiers = [int(r) for r in tiers] if tiers is not None else None
        self.seed = int(seed)

    @property
    def rank_choices(self) -> list[int] | None:
        """The ranks clients may have (``None``: all at the model's rank)."""
        return self.ranks if self.ranks is not None else self.tiers

    def rank_of(self, client: int, rank: int) -> int:
        """Client ``client``'s rank (the model's ``rank`` when no ranks are set)."""
        if self.tiers is not None:
            from fl_lightning.core.participation import derive_seed

            return self.tiers[derive_seed(self.seed, client) % len(self.tiers)]
        return rank if self.ranks is None else self.ranks[client % len(self.ranks)]

    def layer(self, a: Sequence[Tensor], b: Sequence[Tensor], w: Tensor, ctx: LayerRound) -> LayerUpdate:
        raise NotImplementedError


def pad_a(a: Tensor, rank: int) -> Tensor:
    """A ``[r_i, in]`` zero-padded to ``[rank, in]`` (extra rows of zeros)."""
    return torch.cat([a, a.new_zeros(rank - a.shape[0], a.shape[1])]) if a.shape[0] < rank else a


def pad_b(b: Tensor, rank: int) -> Tensor:
    """B ``[out, r_i]`` zero-padded to ``[out, rank]`` (extra columns of zeros)."""
    return torch.cat([b, b.new_zeros(b.shape[0], rank - b.shape[1])], dim=1) if b.shape[1] < rank else b


def mean_product(a: Sequence[Tensor], b: Sequence[Tensor], w: Tensor) -> Tensor:
    """sum_i w_i B_i A_i: the mean of the clients' updates, the target of exact aggregation."""
    return sum(float(wi) * bi @ ai for ai, bi, wi in zip(a, b, w))

"""Partitioners: split the training indices among N clients.

Every partitioner returns an exact partition of ``range(len(labels))``: each
index belongs to exactly one client (no duplicates, nothing dropped).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
from torch import Tensor

from .client_indices import ClientIndices


class Partitioner(ABC):
    """Maps labels and a client count to one index tensor per client.

    ``column``: the per-sample column the partitioner reads instead of the labels (``None``: the
    labels); the datamodule passes that column of its data source (``DataSource.column``).
    """

    column: str | None = None

    @abstractmethod
    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]: ...

    def flat(self, labels: Tensor, num_clients: int, seed: int) -> ClientIndices:
        """The same partition as one flat tensor with offsets (``datamodules/client_indices.py``);
        partitioners that can, build it without a tensor per client."""
        return ClientIndices.from_parts(self(labels, num_clients, seed))

    @staticmethod
    def _as_tensors(parts: list[np.ndarray]) -> list[Tensor]:
        return [torch.as_tensor(np.sort(p), dtype=torch.int64) for p in parts]


class IID(Partitioner):
    """Shuffle and deal the indices into N near-equal parts."""

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        return list(self.flat(labels, num_clients, seed))

    def flat(self, labels: Tensor, num_clients: int, seed: int) -> ClientIndices:
        perm = np.random.default_rng(seed).permutation(len(labels))
        return ClientIndices.from_segments(perm, _split_sizes(len(labels), num_clients))


class Dirichlet(Partitioner):
    """Label skew: each class is split among clients with proportions ~ Dir(alpha).

    Small alpha gives few classes per client; alpha -> infinity approaches IID.
    Draws are repeated (up to ``max_retries``) until every client holds at
    least ``min_size`` samples, as in Hsu et al. 2019 / NIID-Bench.

    Args:
        alpha: concentration, > 0.
        min_size: smallest allowed client, >= 1.
        max_retries: draws before giving up with an error.
    """

    def __init__(self, alpha: float = 0.5, min_size: int = 2, max_retries: int = 1000):
        if not 0 < alpha < np.inf:
            raise ValueError(f"Dirichlet alpha must be > 0 and finite, got {alpha}")
        if min_size < 1:
            raise ValueError(f"Dirichlet min_size must be >= 1, got {min_size}")
        if max_retries < 1:
            raise ValueError(f"Dirichlet max_retries must be >= 1, got {max_retries}")
        self.alpha, self.min_size, self.max_retries = alpha, min_size, max_retries

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        labels = np.asarray(labels)
        n = len(labels)
        if n < num_clients * self.min_size:
            raise ValueError(
                f"{n} training samples cannot give num_clients={num_clients} clients min_size={self.min_size} each; "
                f"need num_clients * min_size <= {n}"
            )
        rng = np.random.default_rng(seed)
        by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        for _ in range(self.max_retries):
            parts: list[list[int]] = [[] for _ in range(num_clients)]
            for idx in by_class:
                idx = rng.permutation(idx)
                props = rng.dirichlet(np.full(num_clients, self.alpha))
                # Balance: clients already holding their fair share take no more of this class.
                sizes = np.array([len(p) for p in parts])
                props = props * (sizes < n / num_clients)
                if props.sum() == 0:
                    props = np.full(num_clients, 1.0)
                props = props / props.sum()
                cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
                for part, chunk in zip(parts, np.split(idx, cuts)):
                    part.extend(chunk.tolist())
            if min(len(p) for p in parts) >= self.min_size:
                return self._as_tensors([np.asarray(p, dtype=np.int64) for p in parts])
        raise ValueError(
            f"Dirichlet(alpha={self.alpha}) found no partition with min_size={self.min_size} for "
            f"{num_clients} clients in {self.max_retries} draws; raise alpha, lower min_size or num_clients"
        )


class Shards(Partitioner):
    """Pathological non-IID (McMahan et al. 2017): sort by label, cut into
    ``num_clients * shards_per_client`` shards, deal ``shards_per_client`` to each client."""

    def __init__(self, shards_per_client: int = 2):
        if shards_per_client < 1:
            raise ValueError(f"Shards shards_per_client must be >= 1, got {shards_per_client}")
        self.shards_per_client = shards_per_client

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        labels = np.asarray(labels)
        num_shards = num_clients * self.shards_per_client
        if num_shards > len(labels):
            raise ValueError(
                f"Shards: num_clients * shards_per_client = {num_shards} exceeds the {len(labels)} training samples"
            )
        rng = np.random.default_rng(seed)
        order = np.argsort(labels, kind="stable")
        shards = np.array_split(order, num_shards)
        deal = rng.permutation(num_shards).reshape(num_clients, self.shards_per_client)
        return self._as_tensors([np.concatenate([shards[s] for s in row]) for row in deal])


class QuantitySkew(Partitioner):
    """Quantity skew: client sizes vary, labels are IID within a client.

    Client shares are drawn once, ``p ~ Dir(alpha)`` (``distribution="dirichlet"``)
    or ``p_i ∝ exp(N(0, sigma^2))`` (``"lognormal"``, as in LEAF/FedProx-style
    unbalanced splits); every client gets ``min_size`` samples plus its share of
    the rest (largest-remainder rounding, so the sizes sum to n exactly), cut
    from one random permutation.

    Args:
        distribution: ``"dirichlet"`` or ``"lognormal"``.
        alpha: Dirichlet concentration, > 0 (small: very unequal sizes).
        sigma: log-normal spread, >= 0 (0: equal sizes).
        min_size: smallest client, >= 1.
    """

    def __init__(self, distribution: str = "lognormal", alpha: float = 1.0, sigma: float = 1.0, min_size: int = 1):
        if distribution not in ("dirichlet", "lognormal"):
            raise ValueError(f"QuantitySkew distribution must be 'dirichlet' or 'lognormal', got {distribution!r}")
        if not alpha > 0:
            raise ValueError(f"QuantitySkew alpha must be > 0, got {alpha}")
        if not sigma >= 0:
            raise ValueError(f"QuantitySkew sigma must be >= 0, got {sigma}")
        if min_size < 1:
            raise ValueError(f"QuantitySkew min_size must be >= 1, got {min_size}")
        self.distribution, self.alpha, self.sigma, self.min_size = distribution, alpha, sigma, min_size

    def sizes(self, n: int, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        if n < num_clients * self.min_size:
            raise ValueError(
                f"{n} training samples cannot give num_clients={num_clients} clients min_size={self.min_size} each"
            )
        if self.distribution == "dirichlet":
            shares = rng.dirichlet(np.full(num_clients, self.alpha))
        else:
            shares = rng.lognormal(0.0, self.sigma, num_clients)
            shares = shares / shares.sum()
        rest = n - num_clients * self.min_size
        raw = shares * rest
        sizes = np.floor(raw).astype(np.int64)
        short = rest - int(sizes.sum())
        sizes[np.argsort(-(raw - sizes), kind="stable")[:short]] += 1
        return sizes + self.min_size

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        return list(self.flat(labels, num_clients, seed))

    def flat(self, labels: Tensor, num_clients: int, seed: int) -> ClientIndices:
        n = len(labels)
        rng = np.random.default_rng(seed)
        sizes = self.sizes(n, num_clients, rng)
        return ClientIndices.from_segments(rng.permutation(n), sizes)


class Contiguous(Partitioner):
    """Deal the indices in order into N contiguous blocks of near-equal size (no shuffling).

    For sources whose training set is already ordered by owner (e.g. ``least_squares``,
    ``samples_per_agent`` rows per agent): with ``num_clients`` equal to the number of
    owners each client gets exactly its owner's data.
    """

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        return list(self.flat(labels, num_clients, seed))

    def flat(self, labels: Tensor, num_clients: int, seed: int) -> ClientIndices:
        if num_clients > len(labels):
            raise ValueError(f"Contiguous: num_clients={num_clients} exceeds the {len(labels)} training samples")
        return ClientIndices.from_segments(np.arange(len(labels)), _split_sizes(len(labels), num_clients))


def _split_sizes(n: int, parts: int) -> np.ndarray:
    """The part sizes of ``np.array_split(range(n), parts)``: the first ``n % parts`` one larger."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


class NaturalPartition(Partitioner):
    """Natural clients: the samples that share a value of a column (a user, a language, a task) stay
    together on one client.

    With as many distinct values as clients, client c holds exactly the c-th value's samples (values in
    sorted order of their codes); with more values than clients, the values are dealt to the clients in a
    seeded random order (each client gets ``ceil`` or ``floor`` of values / clients whole groups).

    Args:
        column: the data source's column (``DataSource.columns``; ``InstructionDataModule``'s
            ``natural_columns`` or its ``label_column``); ``"label"`` uses the labels themselves.
    """

    def __init__(self, column: str = "label") -> None:
        if not column:
            raise ValueError("NaturalPartition column must be a column name")
        self.column = None if column == "label" else column

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        values = np.asarray(labels)
        groups = np.unique(values)
        if len(groups) < num_clients:
            name = self.column or "label"
            raise ValueError(
                f"NaturalPartition(column={name!r}) has {len(groups)} distinct values, fewer than num_clients={num_clients}; "
                f"set num_clients <= {len(groups)}"
            )
        order = groups if len(groups) == num_clients else np.random.default_rng(seed).permutation(groups)
        owner = {int(g): i % num_clients for i, g in enumerate(order)}
        client_of = np.vectorize(owner.__getitem__, otypes=[np.int64])(values) if len(values) else values
        return self._as_tensors([np.flatnonzero(client_of == c) for c in range(num_clients)])

"""FLTrust's root dataset: ``size`` training samples drawn by seed from all clients' training data, held by the
server as one client's data (``ClientData``), so the algorithm's own client rule computes the server's update g0.

The samples are drawn from ``derive_seed(data.seed, ROOT_STREAM)``: the same on every process and after a
resume (nothing to checkpoint); each round's minibatches from ``derive_seed(data.seed, round, ROOT_STREAM)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core import draws
from fl_lightning.core.participation import derive_seed

ROOT_STREAM = 0xF17
"""Seed stream of the root dataset's draw and of the server's minibatches."""


class RootData:
    """One client (id 0) holding ``size`` samples drawn from ``data``'s clients (batches: tuples of tensors)."""

    def __init__(self, data: Any, size: int) -> None:
        parts = [data.client_full_batch(c) for c in range(data.num_clients)]
        if not all(isinstance(p, (tuple, list)) and all(isinstance(t, Tensor) for t in p) for p in parts):
            raise ValueError("robust.rule=fltrust draws its root dataset from batches of tensors (x, y); this data's batches are not")
        pooled = [torch.cat(ts) for ts in zip(*parts)]
        total = len(pooled[0])
        if not 1 <= size <= total:
            raise ValueError(f"robust.root_size must be in [1, {total}] (the training samples), got {size}")
        pick = torch.randperm(total, generator=torch.Generator().manual_seed(derive_seed(data.seed, ROOT_STREAM)))[:size]
        self.samples = tuple(t[pick] for t in pooled)
        self.num_clients, self.seed = 1, data.seed
        self.client_sizes = torch.tensor([size], dtype=torch.int64)

    def num_local_steps(self, client_id: int, batch_size: int | None, steps: int | None, epochs: int | None) -> int:
        return draws.num_local_steps(int(self.client_sizes[0]), batch_size, steps, epochs)

    def client_batches(self, client_id: int, seed: int, batch_size: int | None, steps: int | None = None, epochs: int | None = None) -> Iterator[Any]:
        """The minibatches of ``FederatedDataModule.client_batch_indices`` over the root samples (counter-based
        draws, ``fl_lightning.core.draws``; the whole set every step for null)."""
        for index in draws.client_positions(seed, int(self.client_sizes[0]), batch_size, steps, epochs):
            yield tuple(t[index] for t in self.samples)

    def client_full_batch(self, client_id: int) -> Any:
        return self.samples

    def stacked_client_batches(self, client_ids, seeds, batch_size, steps):
        from fl_lightning.core.client_data import Unstackable

        raise Unstackable("the root dataset trains on the server, alone")

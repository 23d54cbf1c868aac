"""The clients' data as malicious clients see it: their batches poisoned before any executor stacks them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fl_lightning.adversary.base import DataPoisoning, split_batch
from fl_lightning.adversary.malicious import MaliciousClients
from fl_lightning.core.client_data import PaddedBatches
from fl_lightning.core.participation import derive_seed

POISON_STREAM = 0x9015
"""Seed stream of a step's poisoning: ``derive_seed(client round seed, POISON_STREAM, step)``."""
FULL_BATCH_STREAM = 0xF011
"""Round seed of a client's full batch (``derive_seed(data.seed, client, FULL_BATCH_STREAM)``): the same every round."""


class PoisonedData:
    """``data`` (a ``ClientData``) with the malicious clients' batches through ``poisoning``.

    A batch is poisoned from (the client's round seed, the step), so sequential execution (``client_batches``)
    and batched execution (``stacked_client_batches``, each client's row poisoned before the step's clients
    train together) see the same samples. Everything else is ``data``'s."""

    def __init__(self, data: Any, malicious: MaliciousClients, poisoning: DataPoisoning, num_classes: int) -> None:
        self._data, self.malicious, self.poisoning, self.num_classes = data, malicious, poisoning, num_classes

    def __getattr__(self, name: str) -> Any:
        if name == "_data":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        if name.endswith("client_batches"):  # a source of batches this class does not poison is not forwarded: it would train clean
            raise AttributeError(f"{type(self).__name__} has no {name} (its batches would not be poisoned)")
        return getattr(self._data, name)

    def _poison(self, batch: Any, seed: int, step: int) -> tuple[Tensor, Tensor]:
        inputs, labels = split_batch(batch)
        generator = torch.Generator().manual_seed(derive_seed(seed, POISON_STREAM, step))
        return self.poisoning.poison(inputs, labels, self.num_classes, generator)

    def client_batches(
        self, client_id: int, seed: int, batch_size: int | None, steps: int | None = None, epochs: int | None = None
    ) -> Iterator[Any]:
        batches = self._data.client_batches(client_id, seed, batch_size, steps, epochs)
        return batches if client_id not in self.malicious else self._poisoned(batches, seed)

    def stacked_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int
    ) -> Iterator[Any]:
        batches = self._data.stacked_client_batches(client_ids, seeds, batch_size, steps)  # raises Unstackable here
        rows = self._malicious_rows(client_ids, seeds)
        return batches if not rows else self._stacked(batches, rows)

    def _malicious_rows(self, client_ids: Sequence[int], seeds: Sequence[int]) -> list[tuple[int, int]]:
        """``(row, round seed)`` of the malicious clients among stacked ``client_ids``."""
        return [(s, seed) for s, (c, seed) in enumerate(zip(client_ids, seeds)) if int(c) in self.malicious]

    def _stacked(self, batches: Iterator[Any], rows: list[tuple[int, int]], real_rows: Tensor | None = None) -> Iterator[Any]:
        """Stacked batches with the malicious ``rows`` poisoned step by step: their first ``real_rows[s, step]`` samples
        (masked stacking's real rows; None: all of them)."""
        for step, batch in enumerate(batches):
            inputs, labels = (t.clone() for t in split_batch(batch))
            for s, seed in rows:
                if s >= len(inputs):  # a shrunk stack's step: the client is done (``PaddedBatches.leading``)
                    continue
                n = inputs.shape[1] if real_rows is None else int(real_rows[s, step])
                if n:
                    inputs[s, :n], labels[s, :n] = self._poison((inputs[s, :n], labels[s, :n]), seed, step)
            yield inputs, labels

    def round_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None,
        num_steps: Sequence[int],
    ) -> list[Iterator[Any]] | None:
        drawn = getattr(self._data, "round_client_batches", None)
        drawn = drawn(client_ids, seeds, batch_size, steps, epochs, num_steps) if drawn is not None else None
        if drawn is None:
            return None
        return [self._poisoned(batches, seed) if int(c) in self.malicious else batches for c, seed, batches in zip(client_ids, seeds, drawn)]

    def _poisoned(self, batches: Iterator[Any], seed: int) -> Iterator[Any]:
        return (self._poison(batch, seed, step) for step, batch in enumerate(batches))

    def padded_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None,
        num_steps: Sequence[int], min_steps: int = 0, min_rows: int = 0,
    ) -> PaddedBatches:
        """The padded batches (masked stacking) with each malicious client's real rows of each of its real steps
        poisoned as its ``client_batches`` are; padded rows and steps, which train nothing, as they were."""
        padded = self._data.padded_client_batches(client_ids, seeds, batch_size, steps, epochs, num_steps, min_steps, min_rows)
        rows = self._malicious_rows(client_ids, seeds)
        if not rows:
            return padded
        leading = padded.leading
        if leading is not None:
            leading = lambda clients: self._stacked(padded.leading(clients), rows, padded.real_rows)  # noqa: E731
        return dataclasses.replace(padded, batches=self._stacked(padded.batches, rows, padded.real_rows), leading=leading)

    def client_full_batch(self, client_id: int) -> Any:
        batch = self._data.client_full_batch(client_id)
        if client_id not in self.malicious:
            return batch
        return self._poison(batch, derive_seed(self._data.seed, client_id, FULL_BATCH_STREAM), 0)

    def client_label_counts(self, client_id: int) -> Tensor:
        if client_id not in self.malicious:
            return self._data.client_label_counts(client_id)
        labels = self.client_full_batch(client_id)[1]
        return torch.bincount(labels.reshape(-1).long().cpu(), minlength=self.num_classes)

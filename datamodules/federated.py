"""FederatedDataModule: a dataset split among clients, round plans, client batches."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset, default_collate

from .client_indices import ClientIndices, HeldOutSplit, NoIndices
from .partition import Dirichlet, Partitioner
from .sources import SOURCES, DataSource, load_source
from fl_lightning.core import draws
from fl_lightning.core.client_data import IGNORE_TARGET, PaddedBatches, Unstackable, batch_targets
from fl_lightning.core.participation import Participation, RoundPlan, UniformSampling, derive_seed

_HOLDOUT_STREAM = 0x401D
_UNSEEN_STREAM = 0x0E5C
_AUGMENT_STREAM = 0xA06
GATHER_STEPS = 1024
"""Local steps whose in-memory batches are gathered in one indexing op (bounds the memory of long rounds)."""
ROUND_DRAW_LIMIT = 1 << 22  # indices a sequential round draws at once (``round_client_batches``: 32 MiB of int64)
ROUND_GATHER_ROWS = 1024  # samples a client's drawn batches gather at once (``round_client_batches``; CIFAR: 12 MiB)


_DTYPES = {None: None, "float32": torch.float32, "float64": torch.float64}


def _identity(x: Any) -> Any:
    return x


def gather_rows(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor[index]`` for an int64 index of any shape (rows of ``tensor``), by one ``index_select``
    of the flat index: the same tensor, 4-5x faster on CPU than advanced indexing with a 2-3-dim index."""
    index = index.to(tensor.device, non_blocking=True)
    return tensor.index_select(0, index.reshape(-1)).view(*index.shape, *tensor.shape[1:])


def _with_targets(batch: Any, target: Tensor) -> Any:
    """``batch`` with ``target`` in place of its targets (``batch_targets``)."""
    return {**batch, "labels": target} if isinstance(batch, dict) else (*batch[:-1], target)


def _leading_clients(batch: Any, count: int) -> Any:
    """A stacked batch's first ``count`` clients (views)."""
    if isinstance(batch, dict):
        return {k: v[:count] for k, v in batch.items()}
    return tuple(v[:count] for v in batch)


PLAN_BLOCK = 32  # rounds planned at once (``Participation.plans``: equal plans, one seed derivation per block)


class RoundPlans(IterableDataset):
    """Endless stream of round plans, starting at the trainer's current step (so a resume continues)."""

    def __init__(self, datamodule: FederatedDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[RoundPlan]:
        dm = self.datamodule
        trainer = getattr(dm, "trainer", None)
        round_idx = trainer.global_step if trainer is not None else 0
        while True:
            yield from dm.participation.plans(round_idx, PLAN_BLOCK, dm.client_sizes, dm.seed)
            round_idx += PLAN_BLOCK


class FederatedDataModule(L.LightningDataModule):
    """A dataset partitioned among ``num_clients`` clients; implements ``fl_lightning.core.client_data.ClientData``.

    The train "dataloader" yields one ``RoundPlan`` per round; the module pulls
    each active client's batches through ``client_batches``. Validation and test
    use the global test set.

    Args:
        dataset: registered dataset name (see ``datamodules.sources.SOURCES``).
        dataset_args: keyword arguments of the dataset loader.
        num_clients: population size N.
        partition: how training indices are split among clients.
        participation: who is active each round (default: 10% uniformly).
        holdout_fraction: share of each client's data held out for per-client
            evaluation, in [0, 1).
        eval_batch_size: batch size of the global validation/test loaders.
        seed: seed of the partition, the sampling and all client randomness. ``None``
            (the default): the CLI's ``--seed_everything``; 0 outside the CLI.
        val_fraction: share of each client's data held out, pooled over clients, as the
            validation set, in [0, 1). With it, every evaluation logs ``val/*`` on that split
            and ``test/*`` on the test set; without it (0), ``val/*`` is the test set.
        dtype: ``float32`` or ``float64``: cast the floating tensors of the training and test sets
            to it when the data is loaded (integer labels and token ids stay as they are); for float64
            training with ``trainer.precision: 64-true``. ``None`` (the default): the source's own dtype.
        new_client_fraction: share of the ``num_clients`` partitioned clients that never train, in [0, 1)
            (needs ``holdout_fraction > 0``): ``round(fraction * num_clients)`` of them (at least one),
            drawn by the seed. The training federation is the others, numbered ``0 .. num_clients - U - 1``
            (``self.num_clients`` becomes their count after ``setup``); the unseen clients are
            ``self.unseen_clients`` (the ids after them), each with its own training and held-out split,
            evaluated after the algorithm's personalization (docs/personalization.md, "Evaluation protocol").
            ``self.partition_ids[i]`` is the partition's client behind id ``i``.
    """

    def __init__(
        self,
        dataset: str = "digits",
        dataset_args: dict[str, Any] | None = None,
        num_clients: int = 20,
        partition: Partitioner | None = None,
        participation: Participation | None = None,
        holdout_fraction: float = 0.0,
        eval_batch_size: int = 512,
        seed: int | None = None,
        val_fraction: float = 0.0,
        dtype: str | None = None,
        new_client_fraction: float = 0.0,
    ) -> None:
        super().__init__()
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if not 0.0 <= holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
        if not 0.0 <= val_fraction < 1.0 - holdout_fraction:
            raise ValueError(f"val_fraction must be in [0, 1 - holdout_fraction) = [0, {1.0 - holdout_fraction:g}), got {val_fraction}")
        if isinstance(new_client_fraction, bool) or not 0.0 <= new_client_fraction < 1.0:
            raise ValueError(f"data.new_client_fraction must be in [0, 1), got {new_client_fraction}")
        if new_client_fraction and not holdout_fraction > 0:
            raise ValueError(
                f"data.new_client_fraction={new_client_fraction} needs data.holdout_fraction in (0, 1) (unseen clients are scored on "
                "their held-out split), got 0"
            )
        if new_client_fraction and num_clients - max(1, round(new_client_fraction * num_clients)) < 1:
            raise ValueError(f"data.new_client_fraction={new_client_fraction} of num_clients={num_clients} leaves no client to train")
        if eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size}")
        if dtype not in _DTYPES:
            raise ValueError(f"data.dtype must be one of {sorted(k for k in _DTYPES if k)} or null, got {dtype!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"data.seed must be an integer >= 0, got {seed}")
        if type(self).build_source is FederatedDataModule.build_source:
            if dataset not in SOURCES:
                raise ValueError(
                f"unknown dataset {dataset!r}; allowed: {sorted(SOURCES)} (a source registered in your own module: "
                "fl-lightning --import your_module ...)"
            )
            _check_dataset_args(dataset, dict(dataset_args or {}))
        self.dataset = dataset
        self.dataset_args = dict(dataset_args or {})
        self.num_clients = num_clients
        self.partition = partition if partition is not None else Dirichlet(0.5)
        self.participation = participation if participation is not None else UniformSampling(0.1)
        self.participation.validate(num_clients)
        self.holdout_fraction = holdout_fraction
        self.val_fraction = val_fraction
        self.eval_batch_size = eval_batch_size
        self.seed = 0 if seed is None else seed
        self.dtype = dtype
        self.new_client_fraction = new_client_fraction
        self.unseen_clients: list[int] = []  # ids of the clients that never train (``new_client_fraction``)
        self.partition_ids: Tensor | None = None  # the partition's client of each id (None: the identity)
        self.source: DataSource | None = None
        self._resident: Any = None  # the training set on the training device (``place``)

    # ---- building the federation ------------------------------------------------
    def build_source(self) -> DataSource:
        """Load the task's data; subclasses for other data override this."""
        return load_source(self.dataset, **self.dataset_args)

    def setup(self, stage: str | None = None) -> None:
        if self.source is not None:
            return
        source = cast_source(self.build_source(), _DTYPES[self.dtype])
        column = getattr(self.partition, "column", None)
        keys = source.train_labels if column is None else source.column(column)
        parts = self.partition.flat(keys, self.num_clients, self.seed)
        if self.new_client_fraction:
            parts = self._set_aside_unseen(parts)
        sizes = parts.sizes()
        empty = (sizes == 0).nonzero().flatten()
        if len(empty):
            raise ValueError(
                f"partition {type(self.partition).__name__} left {len(empty)} of num_clients={self.num_clients} "
                f"clients empty (e.g. client {int(empty[0])}); use fewer clients or a partition with min_size >= 1"
            )
        if not (self.holdout_fraction or self.val_fraction):
            # Every sample trains: the partition itself, no tensor per client (10^6 clients build in a second).
            self.client_train, self.client_holdout = parts, NoIndices(self.num_clients)
            self._holdout_split = None
            self.validation_indices = torch.empty(0, dtype=torch.int64)
            self.client_sizes = sizes
            self.source = source
            return
        # Each client's split is made when the client is first asked for; only a validation split, pooled
        # over the clients, is a pass over all of them.
        split = HeldOutSplit(parts, self.seed, _HOLDOUT_STREAM, self.holdout_fraction, self.val_fraction)
        starved = (split.train_sizes < 1).nonzero().flatten()
        if len(starved):
            raise ValueError(
                f"holdout_fraction={self.holdout_fraction} and val_fraction={self.val_fraction} leave client {int(starved[0])} no training data"
            )
        self.client_train, self.client_holdout = split.train, split.holdout
        self._holdout_split = split
        if self.val_fraction:
            self.validation_indices = torch.cat([split.split(c)[2] for c in range(len(parts))]).sort().values
            if len(self.validation_indices) == 0:  # nothing to select on: val/acc would never be logged
                largest = int(sizes.max())
                raise ValueError(
                    f"val_fraction={self.val_fraction} holds out no sample: each client keeps floor(val_fraction * size) and the "
                    f"largest client has {largest}; set val_fraction >= {math.ceil(1000 / largest) / 1000:g} (or 0 for no validation split)"
                )
        else:
            self.validation_indices = torch.empty(0, dtype=torch.int64)
        self.client_sizes = split.train_sizes
        if self.unseen_clients:  # the training federation: the clients before the unseen ones
            self.num_clients = self.unseen_clients[0]
            self.client_sizes = split.train_sizes[: self.num_clients]
        self.source = source

    def _set_aside_unseen(self, parts: ClientIndices) -> ClientIndices:
        """The partition's clients renumbered: the training clients first (in partition order), then the
        ``new_client_fraction`` drawn by the seed to never train (``self.unseen_clients``)."""
        total = len(parts)
        count = max(1, round(self.new_client_fraction * total))
        drawn = torch.randperm(total, generator=torch.Generator().manual_seed(derive_seed(self.seed, _UNSEEN_STREAM)))
        unseen = drawn[:count].sort().values
        keep = torch.ones(total, dtype=torch.bool)
        keep[unseen] = False
        self.partition_ids = torch.cat([keep.nonzero().flatten(), unseen])
        self.unseen_clients = list(range(total - count, total))
        return ClientIndices.from_parts([parts[int(c)] for c in self.partition_ids])

    @property
    def num_classes(self) -> int:
        self.setup()
        return self.source.num_classes

    # ---- Lightning loaders ----------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RoundPlans(self), batch_size=None, collate_fn=_identity)

    def _eval_loader(self) -> DataLoader:
        test = self.source.test
        return DataLoader(test, batch_size=self.eval_batch_size, collate_fn=self.source.collate_fn, sampler=_eval_sampler(test))

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation split, then the test set (``val_fraction > 0``); else the test set alone."""
        if not self.val_fraction:
            return self._eval_loader()
        split = Subset(self.source.train, self.validation_indices.tolist())
        loader = DataLoader(split, batch_size=self.eval_batch_size, collate_fn=self.source.collate_fn, sampler=_eval_sampler(split))
        return [loader, self._eval_loader()]

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    # ---- client data access ------------------------------------------------------------
    def place(self, device: torch.device) -> None:
        """Keep the clients' training samples on ``device``, copied there once: client batches are
        then gathered on the device instead of copied to it every step. A training set that is
        neither a ``TensorDataset`` nor has ``to(device)`` stays where it is."""
        train = self.source.train
        if device.type == "cpu":
            self._resident = None
        elif isinstance(train, TensorDataset):
            self._resident = TensorDataset(*(t.to(device) for t in train.tensors))
        elif callable(getattr(train, "to", None)) and callable(getattr(train, "gather", None)):
            self._resident = train.to(device)

    @property
    def _train(self) -> Any:
        return self._resident if self._resident is not None else self.source.train

    @property
    def _vectorised(self) -> bool:
        """Whether the training set gathers an index tensor in a few ops (``_gather``) rather than sample by sample."""
        train = self.source.train
        return isinstance(train, TensorDataset) or callable(getattr(train, "gather", None))

    def _gather(self, indices: Tensor) -> Any:
        """The batch of the samples ``indices`` (CPU int64; any shape ``[..., B]`` for a vectorised training set)."""
        train = self._train
        if isinstance(train, TensorDataset):  # fast path: one indexing op per tensor
            return tuple(gather_rows(t, indices) for t in train.tensors)
        if callable(getattr(train, "gather", None)):
            return cast_batch(train.gather(indices), _DTYPES[self.dtype])
        collate = self.source.collate_fn or default_collate
        return collate([train[int(i)] for i in indices])

    def _gather_steps(self, index: Tensor, step_dim: int) -> Iterator[Any]:
        """``_gather(index.select(step_dim, k))`` for every step k (a dataset's ``gather_steps`` when it has one)."""
        gather_steps = getattr(self._train, "gather_steps", None)
        if callable(gather_steps):
            yield from (cast_batch(b, _DTYPES[self.dtype]) for b in gather_steps(index, step_dim))
            return
        for step in range(index.shape[step_dim]):
            yield self._gather(index.select(step_dim, step))

    def num_local_steps(self, client_id: int, batch_size: int | None, steps: int | None, epochs: int | None) -> int:
        """K for this client: ``steps``, or ``epochs * ceil(n_i / batch_size)``. ``n_i`` is the client's own
        training split, which an unseen client also has (it is not among ``client_sizes``). With ``steps`` the
        size is not looked up (K is ``steps`` whatever it is; a lookup per client and round costs ~10 us)."""
        size = 0 if steps is not None else len(self.client_train[client_id])
        return draws.num_local_steps(size, batch_size, steps, epochs)

    def clients_num_local_steps(self, client_ids: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None) -> list[int]:
        """``num_local_steps`` of every client of ``client_ids`` (the same K): with ``epochs``, their sizes read in one
        gather (``sizes_of``) and K computed for all at once. Client by client where ``num_local_steps`` is overridden."""
        sizes_of = getattr(self.client_train, "sizes_of", None)
        if steps is not None or epochs is None or sizes_of is None or type(self).num_local_steps is not FederatedDataModule.num_local_steps:
            return [self.num_local_steps(c, batch_size, steps, epochs) for c in client_ids]
        ids = torch.as_tensor(client_ids, dtype=torch.int64)
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < len(self.client_train)):
            return [self.num_local_steps(c, batch_size, steps, epochs) for c in client_ids]  # raises, naming the client
        return draws.epochs_local_steps(sizes_of(ids), batch_size, epochs).tolist()

    def augment(self, batch: Any, client_id: int, generator: torch.Generator) -> Any:
        """Transform one training minibatch of ``client_id`` (default: unchanged).

        ``generator`` is seeded from the client's round seed, so an augmentation
        drawn from it is fixed by (seed, round, client).
        """
        return batch

    def client_view(self, batch: Any, client_id: int) -> Any:
        """Transform a client's full-batch or holdout batch (default: unchanged)."""
        return batch

    def client_batch_indices(
        self, client_id: int, seed: int, batch_size: int | None, steps: int | None = None, epochs: int | None = None
    ) -> Iterator[Tensor]:
        """Dataset indices of the client's minibatches for one round, shuffled by ``seed`` (counter-based
        draws, ``fl_lightning.core.draws``: the same rows whether one client or a round's clients are drawn).

        ``steps``: that many batches of ``batch_size`` drawn from reshuffled passes
        over the data. ``epochs``: full passes, the last batch of a pass smaller.
        ``batch_size=None`` (or >= the client's size with ``steps``) means the whole
        local set every step.
        """
        indices = self.client_train[client_id]
        for positions in draws.client_positions(seed, len(indices), batch_size, steps, epochs, GATHER_STEPS):
            yield indices[positions]

    @staticmethod
    def _fixed_step_blocks(seeds: Sequence[int], sizes: Sequence[int], batch_size: int, steps: int) -> Iterator[Tensor]:
        """``draws.fixed_steps`` positions ``[S, <= GATHER_STEPS, batch_size]``, block by block (bounded memory)."""
        for first in range(0, steps, GATHER_STEPS):
            yield draws.fixed_steps(seeds, sizes, batch_size, first, min(GATHER_STEPS, steps - first))

    def _batchable_indices(self, client_id: int, batch_size: int) -> Tensor:
        """The client's training indices, checked to hold at least ``batch_size`` samples."""
        indices = self.client_train[client_id]
        if batch_size > len(indices):
            raise ValueError(f"client {client_id} holds {len(indices)} samples, fewer than batch_size={batch_size}")
        return indices

    def client_batch_index_chunks(self, client_id: int, seed: int, batch_size: int, steps: int) -> Iterator[Tensor]:
        """``client_batch_index_matrix`` in row blocks of at most ``GATHER_STEPS`` steps (bounded memory)."""
        indices = self._batchable_indices(client_id, batch_size)
        return (indices[block[0]] for block in self._fixed_step_blocks([seed], [len(indices)], batch_size, steps))

    def client_batch_index_matrix(self, client_id: int, seed: int, batch_size: int, steps: int) -> Tensor:
        """``client_batch_indices`` for ``steps`` local steps as one ``[steps, batch_size]`` tensor
        (requires ``batch_size`` <= the client's size)."""
        indices = self._batchable_indices(client_id, batch_size)
        return indices[draws.fixed_steps([seed], [len(indices)], batch_size, 0, steps)[0]]

    def _clients_flat(self, client_ids: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``(flat, starts, sizes)``: client ``client_ids[i]``'s training indices are
        ``flat[starts[i] : starts[i] + sizes[i]]`` (no per-client slices where the indices are one flat tensor)."""
        if isinstance(self.client_train, ClientIndices):
            ids = torch.as_tensor(client_ids, dtype=torch.int64)
            offsets = self.client_train.offsets
            return self.client_train.flat, offsets[ids], offsets[ids + 1] - offsets[ids]
        parts = [self.client_train[c] for c in client_ids]
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        return torch.cat(parts), sizes.cumsum(0) - sizes, sizes

    def client_batch_index_matrices(self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int, steps: int) -> Tensor:
        """``client_batch_index_matrix`` of every client, stacked: ``[S, steps, batch_size]``, every client's
        draws in one sort and its indices in one gather."""
        flat, starts, sizes = self._clients_flat(client_ids)
        if len(sizes) and int(sizes.min()) < batch_size:
            for c in client_ids:
                self._batchable_indices(c, batch_size)  # raises, naming the client
        positions = draws.fixed_steps(seeds, sizes, batch_size, 0, steps)
        return flat[positions + starts.view(-1, 1, 1)]

    def _fixed_index_blocks(self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int, steps: int) -> Iterator[Tensor]:
        """``client_batch_index_matrices`` in blocks of at most ``GATHER_STEPS`` steps."""
        flat, starts, sizes = self._clients_flat(client_ids)
        for block in self._fixed_step_blocks(seeds, sizes, batch_size, steps):
            yield flat[block + starts.view(-1, 1, 1)]

    def client_batches(
        self, client_id: int, seed: int, batch_size: int | None, steps: int | None = None, epochs: int | None = None
    ) -> Iterator[Any]:
        """The client's minibatches for one round (see ``client_batch_indices``), passed through ``augment``."""
        generator = self.augment_generator(seed) if self.augments_batches else None  # seeding costs ~15 us
        if batch_size is None or (steps is not None and batch_size >= len(self.client_train[client_id])):
            full = self._gather(self.client_train[client_id])  # gathered once, reused every step
            for _ in range(self.num_local_steps(client_id, batch_size, steps, epochs)):
                yield self.augment(full, client_id, generator)
            return
        if generator is None and steps is not None and self._vectorised:
            # Indices built and gathered GATHER_STEPS steps at a time: memory does not grow with the steps.
            train = self._train
            for chunk in self.client_batch_index_chunks(client_id, seed, batch_size, steps):
                if isinstance(train, TensorDataset):  # a block's batches in one gather per tensor (the same indices, fewer ops)
                    yield from zip(*(gather_rows(t, chunk).unbind(0) for t in train.tensors))
                else:
                    yield from self._gather_steps(chunk, 0)  # padded per step, as a collated batch would be
            return
        for indices in self.client_batch_indices(client_id, seed, batch_size, steps, epochs):
            yield self.augment(self._gather(indices), client_id, generator)

    def round_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None,
        num_steps: Sequence[int],
    ) -> list[Iterator[Any]] | None:
        """``client_batches`` of each of a round's clients (client i's first ``num_steps[i]``), the same batches with
        every client's draws made in one batched sort, as stacked rounds draw them, instead of one sort per client
        (sequential execution: ~50 us a client on CPU). Each client's batches are gathered when its iterator starts.
        None where they are drawn client by client: augmented data, an overridden ``client_batches``, an empty
        client, or more than ``ROUND_DRAW_LIMIT`` indices for the round."""
        if not len(client_ids) or self.augments_batches or type(self).client_batches is not FederatedDataModule.client_batches:
            return None
        if type(self).client_batch_indices is not FederatedDataModule.client_batch_indices:
            return None
        depth, sizes = max(num_steps), self.client_sizes[torch.as_tensor(client_ids, dtype=torch.int64)]
        if depth == 0 or int(sizes.min()) == 0 or len(client_ids) * depth * (batch_size or int(sizes.max())) > ROUND_DRAW_LIMIT:
            return None
        index, real = self._padded_index(client_ids, seeds, batch_size, steps, epochs, num_steps)
        return [self._client_steps(index[i, :k], real[i, :k]) for i, k in enumerate(num_steps)]

    def _client_steps(self, index: Tensor, real: Tensor) -> Iterator[Any]:
        """The batches of ``index`` ``[K, B]`` (step k's first ``real[k]`` rows): one gather per tensor for the steps of
        up to ``ROUND_GATHER_ROWS`` samples (text: each step padded to its longest sample, in one ``gather_steps`` where
        every step is whole)."""
        rows = real.tolist()
        span = max(1, ROUND_GATHER_ROWS // max(1, index.shape[1]))  # steps a gather holds (bounded memory)
        if isinstance(self._train, TensorDataset):
            for first in range(0, len(rows), span):
                block = [gather_rows(t, index[first : first + span]) for t in self._train.tensors]
                for k, n in enumerate(rows[first : first + span]):
                    yield tuple(b[k, :n] for b in block)
        elif all(n == index.shape[1] for n in rows):
            for first in range(0, len(rows), span):
                yield from self._gather_steps(index[first : first + span], 0)
        else:
            for k, n in enumerate(rows):
                yield self._gather(index[k, :n])

    def stacked_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int
    ) -> Iterator[Any]:
        """Step k's ``[S, B, ...]`` batch of all ``client_ids``, k = 0 .. steps-1: the samples (and
        augmentations) of ``client_batches``. Raises ``Unstackable`` at the call if they cannot stack."""
        if not self._vectorised:
            raise Unstackable("the training set gathers sample by sample (neither a TensorDataset nor a dataset with gather(index))")
        if batch_size is None:
            raise Unstackable("local.batch_size is null (full-batch local steps: each client's batch is all its samples), so batches are not stacked")
        if bool((self.client_sizes[torch.as_tensor(client_ids, dtype=torch.int64)] < batch_size).any()):
            raise Unstackable("a client holds fewer samples than local.batch_size, so batches cannot be stacked")
        if self.augments_batches and not isinstance(self.source.train, TensorDataset):
            raise Unstackable("augmented batches are stacked from in-memory tensors (TensorDataset) only")
        return self._stacked(self._fixed_index_blocks(client_ids, seeds, batch_size, steps), client_ids, seeds)

    def padded_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None,
        num_steps: Sequence[int], min_steps: int = 0, min_rows: int = 0,
    ) -> PaddedBatches:
        """The clients' batches of ``client_batches`` (client i's first ``num_steps[i]``), padded to one
        ``[S, B, ...]`` batch per step for masked stacking (docs/performance.md, "Masked stacking"): K and B
        are the round's largest (``bucket(K)``, ``bucket(B)`` where given); a padded row repeats one of the
        client's samples with target ``IGNORE_TARGET`` (cross-entropy's ``ignore_index``: it adds nothing to
        the loss or its gradient, and the mean is over real rows), a padded step repeats the client's first
        batch and is masked out by the executor (``PaddedBatches.step_mask``). Raises ``Unstackable`` at
        the call if the batches cannot be padded."""
        in_memory = isinstance(self.source.train, TensorDataset)
        if not in_memory and not callable(getattr(self._train, "gather", None)):
            raise Unstackable(
                "padded stacking (clients with unequal steps or batch sizes) gathers from in-memory tensors (TensorDataset) "
                "or a dataset with gather(index) (text) only"
            )
        if not in_memory and self.augments_batches:
            raise Unstackable("augmented batches are padded from in-memory tensors (TensorDataset) only")
        index, real = self._padded_index(client_ids, seeds, batch_size, steps, epochs, num_steps)
        depth, width = max(index.shape[1], min_steps), max(index.shape[2], min_rows)
        if depth > index.shape[1]:  # padded steps: the first's rows
            index = torch.cat([index, index[:, :1].expand(-1, depth - index.shape[1], -1)], 1)
            real = torch.cat([real, real.new_zeros(len(real), depth - real.shape[1])], 1)
        if width > index.shape[2]:  # padded rows: the step's first
            index = torch.cat([index, index[:, :, :1].expand(-1, -1, width - index.shape[2])], 2)
        rows_padded = bool(((real > 0) & (real < width)).any())
        target = None if not rows_padded else self.source.train.tensors[-1] if in_memory else batch_targets(self._gather(index.reshape(-1)[:1]))
        if rows_padded and (target.is_floating_point() or (in_memory and target.dim() != 1)):  # text: a row's tokens masked alike
            raise Unstackable(
                "clients' batches of unequal size are padded, and padded rows are masked through integer class targets "
                "(cross-entropy's ignore_index); these targets are not"
            )
        # a padded step is a copy of the client's first batch (rows and row mask): finite, and masked out as a step
        filled = torch.where(real > 0, real, real[:, :1])
        row_mask = torch.arange(width).view(1, 1, width) < filled.unsqueeze(-1)
        steps = functools.partial(self._padded_steps, index, row_mask, real, client_ids, seeds)
        return PaddedBatches(steps(), real > 0, real, depth, width, leading=steps)

    def _padded_index(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int | None, epochs: int | None,
        num_steps: Sequence[int],
    ) -> tuple[Tensor, Tensor]:
        """``(index [S, K, B], real [S, K])``: the dataset indices of ``client_batch_indices`` of every client
        (client i's first ``num_steps[i]`` batches) and each batch's real rows (0 at a step past ``num_steps[i]``);
        a padded row or step repeats the client's first sample of the step."""
        flat, starts, sizes = self._clients_flat(client_ids)
        seeds = torch.as_tensor(seeds, dtype=torch.int64)
        if epochs is not None or batch_size is None:  # epochs, or full-batch steps
            positions, real = draws.epoch_steps(seeds, sizes, batch_size, epochs if epochs is not None else steps)
        else:  # fixed steps of batch_size; a client of at most batch_size samples takes all of them every step
            whole = sizes <= batch_size
            width = max(int(sizes[whole].max()) if bool(whole.any()) else 0, batch_size if not bool(whole.all()) else 0)
            positions = torch.zeros(len(sizes), steps, width, dtype=torch.int64)
            real = torch.zeros(len(sizes), steps, dtype=torch.int64)
            if bool(whole.any()):
                own, rows = draws.epoch_steps(seeds[whole], sizes[whole], None, steps)
                positions[whole, :, : own.shape[2]], real[whole] = own, rows
            if not bool(whole.all()):
                positions[~whole, :, :batch_size] = draws.fixed_steps(seeds[~whole], sizes[~whole], batch_size, 0, steps)
                real[~whole] = batch_size
        depth = max(num_steps)
        positions, real = positions[:, :depth], real[:, :depth].clone()
        real.masked_fill_(torch.arange(depth).view(1, -1) >= torch.as_tensor(list(num_steps)).view(-1, 1), 0)
        # Padded rows already repeat the step's first position (draws.epoch_steps; a whole client's zeros are its first).
        positions = torch.where((real > 0).unsqueeze(-1), positions, positions[:, :1])  # padded steps: the first step
        return gather_rows(flat, positions + starts.view(-1, 1, 1)), real

    def _padded_steps(
        self, index: Tensor, row_mask: Tensor, real: Tensor, client_ids: Sequence[int], seeds: Sequence[int], clients: Sequence[int] | None = None
    ) -> Iterator[Any]:
        """Step by step, the ``[S, B, ...]`` batches of ``index`` with padded rows' targets ``IGNORE_TARGET``;
        where the data augments, each client's real batches go through ``augment`` in order, drawn as
        ``client_batches`` draws them (a padded step is not augmented: it is masked out). ``clients``
        (``PaddedBatches.leading``): step k's batch holds its first ``clients[k]`` clients only (in-memory tensors
        gather only theirs; text, padded to the step's longest sample of every client, is cut after its gather)."""
        size = len(client_ids)
        cut = [size] * index.shape[1] if clients is None else [min(size, n) for n in clients]
        if not isinstance(self.source.train, TensorDataset):  # text: each step padded to its longest sample, as stacked rounds are
            for k, batch in enumerate(self._gather_steps(index, 1)):
                target = batch_targets(batch)  # [S, B] class labels, or [S, B, T] token labels: a padded row's all masked
                real_rows = row_mask[:, k].reshape(*row_mask.shape[::2], *[1] * (target.dim() - 2)).to(target.device)
                batch = _with_targets(batch, target.masked_fill(~real_rows, IGNORE_TARGET))
                yield batch if cut[k] == size else _leading_clients(batch, cut[k])
            return
        generators = [self.augment_generator(s) for s in seeds] if self.augments_batches else None
        *features, targets = self.source.train.tensors
        steps_first, masks = index.transpose(0, 1).contiguous(), row_mask.transpose(0, 1)  # [K, S, B]
        targets = gather_rows(targets, steps_first).masked_fill(~masks.to(targets.device), IGNORE_TARGET)  # every step's at once: small
        first: list[Any] = [None] * len(client_ids)  # each client's augmented first batch (its padded steps' copy)
        for k in range(steps_first.shape[0]):
            running = cut[k]
            inputs, target = [gather_rows(t, steps_first[k, :running]) for t in features], targets[k, :running]
            if generators is None:
                yield (*inputs, target)
                continue
            views = []
            for i, (c, g) in enumerate(zip(client_ids[:running], generators)):
                n, width = int(real[i, k]), target.shape[1]
                if n:
                    out = self.augment((*(x[i, :n] for x in inputs), target[i, :n]), c, g)[:-1]
                    out = [torch.cat([y, y[:1].expand(width - n, *y.shape[1:])]) for y in out]
                    first[i] = out if first[i] is None else first[i]
                views.append(out if n else first[i])
            yield (*(torch.stack(parts) for parts in zip(*views)), target)

    def _stacked(self, blocks: Iterator[Tensor], client_ids: Sequence[int], seeds: Sequence[int]) -> Iterator[Any]:
        """Step by step from ``[S, <= GATHER_STEPS, B]`` index blocks (never more than that at once)."""
        generators = [self.augment_generator(s) for s in seeds] if self.augments_batches else None
        for index in blocks:  # [S, steps of this block, B]
            if generators is None and isinstance(self._train, TensorDataset):  # one gather per tensor for all clients and steps
                steps_first = index.transpose(0, 1).contiguous()  # [steps, S, B]: every step's batch a contiguous block
                yield from zip(*(gather_rows(t, steps_first).unbind(0) for t in self._train.tensors))
                continue
            if generators is None:  # one gather for all clients (text: padded to the step's longest sample)
                yield from self._gather_steps(index, 1)
                continue
            tensors = self.source.train.tensors
            for step in range(index.shape[1]):
                views = [self.augment(tuple(t[i] for t in tensors), c, g)  # per-client transforms, then stacked
                         for i, c, g in zip(index[:, step], client_ids, generators)]  # fmt: skip
                yield tuple(torch.stack(parts) for parts in zip(*views))

    @property
    def augments_batches(self) -> bool:
        """Whether ``augment`` is overridden (batched execution then transforms client by client)."""
        return type(self).augment is not FederatedDataModule.augment

    @staticmethod
    def augment_generator(seed: int) -> torch.Generator:
        """The generator ``augment`` draws from in a client's round (seeded by its round seed)."""
        return torch.Generator().manual_seed(derive_seed(seed, _AUGMENT_STREAM))

    def client_full_batch(self, client_id: int) -> Any:
        return self.client_view(self._gather(self.client_train[client_id]), client_id)

    def client_records(self, client_ids: Sequence[int], positions: Tensor) -> Any:
        """The ``[S, B, ...]`` batch of records ``positions[s, j]`` (into client ``client_ids[s]``'s training
        records) of every client: record-level DP-SGD's drawn batches (``fl_lightning.executors.dpsgd``)."""
        index = torch.stack([self.client_train[c][p] for c, p in zip(client_ids, positions)])
        if self._vectorised:
            return self._gather(index)
        return default_collate([self._gather(row) for row in index])  # sample by sample, then stacked

    def client_label_counts(self, client_id: int) -> Tensor:
        """The client's training samples per class (int64 ``[num_classes]``), the client statistic that
        label-aware local losses read (FedLC, FedRS): counted from its training targets once, then kept."""
        cache = self.__dict__.setdefault("_label_counts", {})
        counts = cache.get(client_id)
        if counts is None:
            target = batch_targets(self._gather(self.client_train[client_id]))
            counts = cache[client_id] = torch.bincount(target.reshape(-1).long().cpu(), minlength=self.num_classes)
        return counts

    def client_holdout_batch(self, client_id: int, part: str | None = None) -> Any:
        """The client's held-out samples: all of them, or its ``"validation"`` or ``"test"`` half
        (``client_holdout_part``)."""
        indices = self.client_holdout[client_id] if part is None else self.client_holdout_part(client_id, part)
        return self.client_view(self._gather(indices), client_id)

    def client_holdout_part(self, client_id: int, part: str) -> Tensor:
        """The indices of the client's held-out ``"validation"`` half (personalized selection) or ``"test"`` half
        (personalized reporting); empty without a held-out split."""
        split = getattr(self, "_holdout_split", None)
        if split is None:
            return self.client_holdout[client_id]
        return split.holdout_parts(client_id)[("validation", "test").index(part)]


def _eval_sampler(dataset: Any) -> Any:
    """Under DDP each rank evaluates its own share of ``dataset``, no sample twice, and the metrics are
    summed over the ranks: the one-process numbers. (Lightning's default DistributedSampler pads the set
    with repeated samples to a multiple of the ranks.) One process: None, the loader's own order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    return UnrepeatedDistributedSampler(dataset, shuffle=False)


def _check_dataset_args(dataset: str, args: dict[str, Any]) -> None:
    """Unknown ``dataset_args`` keys are named with the allowed ones, before any data is loaded."""
    import inspect

    parameters = inspect.signature(SOURCES[dataset]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    allowed = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in allowed:
            raise ValueError(f"data.dataset_args: unknown key {key!r} for dataset {dataset!r}; allowed: {allowed}")


def cast_source(source: DataSource, dtype: torch.dtype | None) -> DataSource:
    """``source`` with the floating tensors of its training and test sets in ``dtype`` (None: unchanged).

    ``TensorDataset``s are cast once; any other dataset casts each batch through the collate
    function (the evaluation loaders, sample-by-sample client batches); a training set with its
    own ``gather`` is cast by the datamodule's ``_gather`` (``cast_batch``)."""
    if dtype is None:
        return source

    def cast_set(data: Any) -> Any:
        return TensorDataset(*(cast_batch(t, dtype) for t in data.tensors)) if isinstance(data, TensorDataset) else data

    train, test = cast_set(source.train), cast_set(source.test)
    collate = source.collate_fn
    if not (isinstance(train, TensorDataset) and isinstance(test, TensorDataset)):
        def collate(samples: list, inner=source.collate_fn or default_collate) -> Any:
            return cast_batch(inner(samples), dtype)

    return dataclasses.replace(source, train=train, test=test, collate_fn=collate)  # columns and the rest kept


def cast_batch(batch: Any, dtype: torch.dtype | None) -> Any:
    """The batch with every floating tensor in ``dtype`` (None: unchanged)."""
    if dtype is None:
        return batch
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(batch, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

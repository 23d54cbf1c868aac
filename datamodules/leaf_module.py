"""LeafDataModule: natural users from a LEAF folder, each user one client."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset

from fl_lightning.core.participation import Participation, UniformSampling

from .client_indices import HeldOutSplit
from .federated import _DTYPES, _HOLDOUT_STREAM, FederatedDataModule
from .leaf import TASKS, LeafData, leaf_files, read_leaf
from .sources import DataSource


class LeafDataModule(FederatedDataModule):
    """The users of a LEAF folder (Caldas et al. 2018) as the clients (docs/fairness.md, "Natural users").

    Every user with training samples is one client, holding exactly its LEAF training samples in their file
    order. Its held-out split is its LEAF test samples (``-t sample``: each user's own; ``-t user``: LEAF puts
    whole users in the test files, so the clients have none): half of them, drawn by the seed, select
    (``val/personal_*``), the other half report (``test/personal_*``), as for the held-out split of
    ``holdout_fraction``. The global validation and test set is every test sample read (the clients' and those
    of users found only in the test files). ``holdout_fraction`` is 1.0: it marks that each client has a given
    held-out split, so the per-client evaluation runs; the split is LEAF's, not a drawn share.

    Args:
        root: the LEAF folder holding ``train/*.json`` and ``test/*.json`` (LEAF's ``data/<task>/data``).
        task: ``"femnist"`` (x: 784 floats, a ``[1, 28, 28]`` image; y: 62 classes) or ``"shakespeare"``
            (x: 80 characters as int64 codes of ``leaf.SHAKESPEARE_LETTERS``; y: the next character's code, 81 classes).
        num_clients: the first this many users (files sorted by name, users in file order; the other training files
            are still parsed, to tell their users from those found only in the test files); ``None``: every user.
        val_fraction: share of each client's training samples held out, pooled over the clients, as the
            validation set, in [0, 1) (``FederatedDataModule``); 0: the global validation set is the test set.
        participation, eval_batch_size, seed, dtype: as ``FederatedDataModule`` (``dtype`` is FEMNIST's pixels).
    """

    def __init__(
        self,
        root: str,
        task: str = "femnist",
        num_clients: int | None = None,
        participation: Participation | None = None,
        eval_batch_size: int = 512,
        val_fraction: float = 0.0,
        seed: int | None = None,
        dtype: str | None = None,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"data.task must be one of {sorted(TASKS)}, got {task!r}")
        if num_clients is not None and (isinstance(num_clients, bool) or num_clients < 1):
            raise ValueError(f"data.num_clients must be >= 1 or null (every user), got {num_clients}")
        if not os.path.isdir(root):
            raise ValueError(f"data.root: {root} is not a folder (a LEAF folder with train/ and test/)")
        for split in ("train", "test"):
            leaf_files(root, split)
        super().__init__(dataset=f"leaf_{task}", num_clients=num_clients or 1, eval_batch_size=eval_batch_size, seed=seed, dtype=dtype,
                         val_fraction=val_fraction)  # fmt: skip
        self.participation = participation if participation is not None else UniformSampling(0.1)
        if num_clients is not None:
            self.participation.validate(num_clients)
        self.root, self.task, self.max_users = root, task, num_clients
        self.holdout_fraction = 1.0  # a given held-out split per client (LEAF's), read when the data is loaded
        self.leaf: LeafData | None = None

    def build_source(self) -> DataSource:
        self.leaf = read_leaf(self.root, self.task, self.max_users, _DTYPES[self.dtype] or torch.float32)
        x, y, n = self.leaf.x, self.leaf.y, self.leaf.num_train
        # one tensor for both splits: the training set's rows past n are the test set (a view, not a copy)
        return DataSource(TensorDataset(x, y), TensorDataset(x[n:], y[n:]), y[:n], self.leaf.num_classes)

    def setup(self, stage: str | None = None) -> None:
        if self.source is not None:
            return
        source = self.build_source()
        leaf = self.leaf
        if self.max_users is not None and len(leaf.users) < self.max_users:
            raise ValueError(f"data.num_clients={self.max_users} exceeds the {len(leaf.users)} users with training samples in {self.root}")
        self.participation.validate(len(leaf.users))
        self.num_clients = len(leaf.users)
        self.client_train, self.client_holdout = leaf.train, leaf.holdout
        self._holdout_split = HeldOutSplit(leaf.holdout, self.seed, _HOLDOUT_STREAM, 1.0, 0.0)
        self.validation_indices = torch.empty(0, dtype=torch.int64)
        if self.val_fraction:
            self._split_validation(leaf)
        self.client_sizes = self.client_train.sizes_of(torch.arange(self.num_clients))
        self.source = source

    def _split_validation(self, leaf: LeafData) -> None:
        """Each client's training samples less ``floor(val_fraction * n)`` drawn by the seed, pooled as the validation set."""
        split = HeldOutSplit(leaf.train, self.seed, _HOLDOUT_STREAM, 0.0, self.val_fraction)
        starved = (split.train_sizes < 1).nonzero().flatten()
        if len(starved):
            raise ValueError(f"val_fraction={self.val_fraction} leaves client {int(starved[0])} ({leaf.users[int(starved[0])]!r}) no training data")
        self.client_train = split.train
        self.validation_indices = torch.cat([split.split(c)[2] for c in range(len(leaf.users))]).sort().values
        if not len(self.validation_indices):
            raise ValueError(f"val_fraction={self.val_fraction} holds out no sample: each client keeps floor(val_fraction * size); raise it")

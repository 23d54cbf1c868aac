"""Datasets by name: each loader returns a ``DataSource`` (train set, test set, labels).

Register a new dataset with ``@register("name")``; the datamodule's ``dataset``
setting picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset


@dataclass
class DataSource:
    """A task's data before federation.

    ``train_labels`` drive label-skew partitions. A ``TensorDataset`` train set
    takes the in-memory fast path (batches by tensor indexing, no DataLoader).
    """

    train: Dataset
    test: Dataset
    train_labels: Tensor
    num_classes: int
    collate_fn: Callable | None = None


SOURCES: dict[str, Callable[..., DataSource]] = {}


def register(name: str):
    def wrap(fn: Callable[..., DataSource]) -> Callable[..., DataSource]:
        SOURCES[name] = fn
        return fn

    return wrap


def load_source(name: str, **kwargs) -> DataSource:
    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; allowed: {sorted(SOURCES)}")
    return SOURCES[name](**kwargs)


def _split(x: Tensor, y: Tensor, test_fraction: float, seed: int, num_classes: int) -> DataSource:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    return DataSource(TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), y[train], num_classes)


@register("digits")
def digits(test_fraction: float = 0.2, seed: int = 0) -> DataSource:
    """scikit-learn's bundled handwritten digits (1797 images, 8x8, 10 classes), offline.

    Images are scaled to [0, 1] and shaped ``[n, 1, 8, 8]``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return _split(x, y, test_fraction, seed, num_classes=10)


@register("synthetic")
def synthetic(
    num_samples: int = 2000,
    num_features: int = 20,
    num_classes: int = 10,
    class_separation: float = 2.0,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> DataSource:
    """Gaussian classes: class c has mean ``class_separation * mu_c`` (mu_c ~ N(0, I/d)) and unit noise."""
    if num_samples < 2 or num_features < 1 or num_classes < 2:
        raise ValueError(
            f"synthetic needs num_samples >= 2, num_features >= 1, num_classes >= 2; got "
            f"{num_samples}, {num_features}, {num_classes}"
        )
    rng = np.random.default_rng(seed)
    means = class_separation * rng.normal(size=(num_classes, num_features)) / np.sqrt(num_features)
    y = rng.integers(0, num_classes, size=num_samples)
    x = means[y] + rng.normal(size=(num_samples, num_features))
    return _split(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64), test_fraction, seed, num_classes)

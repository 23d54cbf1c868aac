"""Datasets by name: each loader returns a ``DataSource`` (train set, test set, labels).

Register a new dataset with ``@register("name")``; the datamodule's ``dataset``
setting picks it, and ``dataset_args`` are its loader's keyword arguments (any names). A
module of your own that registers one is imported by ``fl-lightning --import my_data ...``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset


@dataclass
class DataSource:
    """A task's data before federation.

    ``train_labels`` drive label-skew partitions. A ``TensorDataset`` train set
    takes the in-memory fast path (batches by tensor indexing, no DataLoader).
    ``columns`` holds further integer-coded per-sample columns of the train set (e.g. a user id)
    that a partitioner may name (``NaturalPartition(column=...)``).
    """

    train: Dataset
    test: Dataset
    train_labels: Tensor
    num_classes: int
    collate_fn: Callable | None = None
    columns: dict[str, Tensor] = field(default_factory=dict)

    def column(self, name: str) -> Tensor:
        """The per-sample codes of column ``name`` of the train set (one line naming the offered ones otherwise)."""
        if name not in self.columns:
            raise ValueError(
                f"the partition names column {name!r}, which this data source does not offer; offered: {sorted(self.columns)} "
                "(InstructionDataModule: list it in data.init_args.natural_columns)"
            )
        return self.columns[name]


SOURCES: dict[str, Callable[..., DataSource]] = {}


def register(name: str):
    def wrap(fn: Callable[..., DataSource]) -> Callable[..., DataSource]:
        SOURCES[name] = fn
        return fn

    return wrap


def load_source(dataset: str, /, **kwargs) -> DataSource:
    """The source registered as ``dataset``, loaded with ``kwargs`` (any names, ``name`` and
    ``dataset`` included: the registry's own parameter is positional-only)."""
    if dataset not in SOURCES:
        raise ValueError(
            f"unknown dataset {dataset!r}; allowed: {sorted(SOURCES)} (a source registered in your own module: "
            "fl-lightning --import your_module ...)"
        )
    return SOURCES[dataset](**kwargs)


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


@register("least_squares")
def least_squares(
    num_agents: int = 18,
    samples_per_agent: int = 50,
    num_features: int = 5,
    noise: float = 0.1,
    feature_shift: float = 0.5,
    theta_spread: float = 0.0,
    test_per_agent: int = 10,
    seed: int = 0,
) -> DataSource:
    """Per-agent linear regression data ``y = q theta_n + noise`` (the shape of Rostami & Kia, Sec. VI).

    Agents are heterogeneous in their features: agent n draws ``q = s_n + 0.5 * U(0, 1)^d`` with its
    own shift ``s_n ~ U(0, feature_shift)^d`` (so each local cost has its own curvature and
    optimum). ``theta_n = theta + theta_spread * N(0, I)`` around a common ``theta ~ U(-1, 1)^d``
    adds concept shift. The training set is ordered by agent, ``samples_per_agent`` rows each, and
    ``train_labels`` holds the agent id of each row: use the ``Contiguous`` partitioner with
    ``num_clients = num_agents`` to give every agent its own samples. Targets are float32 of
    shape [n] (for ``LinearRegression.loss``).
    """
    if num_agents < 1 or samples_per_agent < 1 or num_features < 1 or test_per_agent < 1:
        raise ValueError(
            "least_squares needs num_agents, samples_per_agent, num_features, test_per_agent >= 1; got "
            f"{num_agents}, {samples_per_agent}, {num_features}, {test_per_agent}"
        )
    if noise < 0 or feature_shift < 0 or theta_spread < 0:
        raise ValueError(f"least_squares noise, feature_shift, theta_spread must be >= 0; got {noise}, {feature_shift}, {theta_spread}")
    rng = np.random.default_rng(seed)
    theta = rng.uniform(-1.0, 1.0, num_features)
    parts: dict[str, list] = {"xtr": [], "ytr": [], "xte": [], "yte": []}
    for _ in range(num_agents):
        shift = rng.uniform(0.0, feature_shift, num_features)
        theta_n = theta + theta_spread * rng.normal(size=num_features)
        for split, count in (("tr", samples_per_agent), ("te", test_per_agent)):
            q = shift + 0.5 * rng.uniform(0.0, 1.0, (count, num_features))
            parts["x" + split].append(q)
            parts["y" + split].append(q @ theta_n + noise * rng.normal(size=count))
    x_train, y_train, x_test, y_test = (torch.tensor(np.concatenate(parts[k]), dtype=torch.float32) for k in ("xtr", "ytr", "xte", "yte"))
    agents = torch.arange(num_agents, dtype=torch.int64).repeat_interleave(samples_per_agent)
    return DataSource(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), agents, num_classes=1)

"""Binary tasks for the partial-personalization experiment: label c = +1 iff digit >= threshold.

``train_labels`` keep the ten digit classes, so label-skew partitions (Dirichlet,
Shards) make the clients heterogeneous as with the full task.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .sources import DataSource, digits, register


def _binarize(source: DataSource, threshold: int) -> DataSource:
    if not 1 <= threshold <= source.num_classes - 1:
        raise ValueError(f"threshold must be in [1, {source.num_classes - 1}], got {threshold}")
    (x_tr, y_tr), (x_te, y_te) = source.train.tensors, source.test.tensors
    train = TensorDataset(x_tr, (y_tr >= threshold).long())
    test = TensorDataset(x_te, (y_te >= threshold).long())
    return DataSource(train, test, source.train_labels, num_classes=2)


@register("binary_digits")
def binary_digits(threshold: int = 5, test_fraction: float = 0.2, seed: int = 0) -> DataSource:
    """scikit-learn's 8x8 digits (offline), digit >= ``threshold`` vs the rest; 64 features."""
    return _binarize(digits(test_fraction, seed), threshold)


@register("binary_mnist")
def binary_mnist(path: str = "ylecun/mnist", threshold: int = 5, max_train: int | None = None) -> DataSource:
    """MNIST through the ``datasets`` library (Hub id or local folder with train/test parquet files,
    columns ``image`` and ``label``), pixels scaled to [0, 1], 784 features. Needs the data cached
    locally when offline. ``max_train`` keeps the first that many training images."""
    from datasets import load_dataset

    data = load_dataset(path)
    parts = []
    for split in ("train", "test"):
        ds = data[split] if max_train is None or split == "test" else data[split].select(range(max_train))
        x = np.stack([np.asarray(img, dtype=np.float32) for img in ds["image"]]) / 255.0
        parts.append((torch.from_numpy(x).unsqueeze(1), torch.tensor(ds["label"], dtype=torch.int64)))
    (x_tr, y_tr), (x_te, y_te) = parts
    source = DataSource(TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te), y_tr, num_classes=10)
    return _binarize(source, threshold)


__all__ = ["binary_digits", "binary_mnist"]

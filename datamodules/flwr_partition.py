"""A Flower Datasets partitioner as this project's partition (``flwr-datasets``: Beutel et al., "Flower Datasets",
2024; its ``DirichletPartitioner``, ``PathologicalPartitioner``, ``ShardPartitioner``, ``InnerDirichletPartitioner``,
...). The partitioner reads a ``datasets.Dataset`` of the data source's labels (or the partition's column) beside
each sample's index, and client c holds the indices of ``load_partition(c)``: the partitioner's own split, on any
data source of the project."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import numpy as np
from torch import Tensor

from .partition import Partitioner

INDEX = "__index__"


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"FlwrPartition partitioner {path!r} is not an importable class (pip install flwr-datasets?): {error}") from error


class FlwrPartition(Partitioner):
    """Args:
        partitioner: the partitioner's class path, e.g. ``flwr_datasets.partitioner.DirichletPartitioner``: any class
            whose instances take ``.dataset = ...`` and give ``load_partition(i)`` (Flower Datasets' interface).
        init_args: its arguments; ``num_partitions`` is the datamodule's ``num_clients`` and ``seed`` the data's seed
            where the class takes them and they are not given.
        column: the data source's column the partitioner reads (``partition_by``); ``"label"``: the labels.
    """

    def __init__(self, partitioner: str, init_args: dict[str, Any] | None = None, column: str = "label") -> None:
        if not isinstance(partitioner, str) or "." not in partitioner:
            raise ValueError(f"FlwrPartition partitioner must be a class path like flwr_datasets.partitioner.IidPartitioner, got {partitioner!r}")
        self.partitioner, self.init_args = partitioner, dict(init_args or {})
        self.column = None if column == "label" else column
        self.partition_by = self.init_args.get("partition_by", column)

    def build(self, num_clients: int, seed: int) -> Any:
        """The partitioner, with the clients' count and the seed where it takes them."""
        cls = _class(self.partitioner)
        takes = inspect.signature(cls).parameters
        kwargs = dict(self.init_args)
        for name, value in (("num_partitions", num_clients), ("seed", seed)):
            if name in takes and name not in kwargs:
                kwargs[name] = value
        return cls(**kwargs)

    def __call__(self, labels: Tensor, num_clients: int, seed: int) -> list[Tensor]:
        import datasets

        partitioner = self.build(num_clients, seed)
        values = np.asarray(labels)
        partitioner.dataset = datasets.Dataset.from_dict({self.partition_by: values.tolist(), INDEX: np.arange(len(values)).tolist()})
        parts = [np.asarray(partitioner.load_partition(c)[INDEX], dtype=np.int64) for c in range(num_clients)]
        taken = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(taken) != len(values) or len(np.unique(taken)) != len(values):
            raise ValueError(
                f"FlwrPartition: {self.partitioner}'s {num_clients} partitions hold {len(np.unique(taken))} distinct of the {len(values)} "
                f"samples ({len(taken)} in all); a federated partition gives every sample to exactly one client"
            )
        return self._as_tensors(parts)

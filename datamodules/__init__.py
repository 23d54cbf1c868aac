"""Federated datamodules, partitioners and dataset sources."""

from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Dirichlet, Partitioner, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register
from datamodules import binary  # noqa: F401,E402  (registers binary_digits, binary_mnist)

__all__ = [
    "IID",
    "SOURCES",
    "DataSource",
    "Dirichlet",
    "FederatedDataModule",
    "Partitioner",
    "RoundPlans",
    "Shards",
    "load_source",
    "register",
]

"""Federated datamodules, partitioners and dataset sources."""

from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Contiguous, Dirichlet, Partitioner, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register

__all__ = [
    "IID",
    "Contiguous",
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

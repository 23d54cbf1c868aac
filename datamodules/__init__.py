"""Federated datamodules, partitioners and dataset sources."""

from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Dirichlet, Partitioner, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register
from datamodules.text import TASKS, TextDataModule

__all__ = [
    "IID",
    "SOURCES",
    "DataSource",
    "Dirichlet",
    "FederatedDataModule",
    "Partitioner",
    "RoundPlans",
    "Shards",
    "TASKS",
    "TextDataModule",
    "load_source",
    "register",
]

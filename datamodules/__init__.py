"""Federated datamodules, partitioners and dataset sources."""

from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Dirichlet, Partitioner, QuantitySkew, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register
from datamodules.vision import SPECS, VisionDataModule
from datamodules.augment import ColorPerturbation

__all__ = [
    "IID",
    "SPECS",
    "ColorPerturbation",
    "QuantitySkew",
    "VisionDataModule",
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

"""Federated datamodules, partitioners and dataset sources."""

from datamodules.augment import ColorPerturbation
from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Dirichlet, Partitioner, QuantitySkew, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register
from datamodules.vision import SPECS, VisionDataModule
from datamodules import binary  # noqa: F401,E402  (registers binary_digits, binary_mnist)

__all__ = [
    "IID",
    "SOURCES",
    "SPECS",
    "ColorPerturbation",
    "DataSource",
    "Dirichlet",
    "FederatedDataModule",
    "Partitioner",
    "QuantitySkew",
    "RoundPlans",
    "Shards",
    "VisionDataModule",
    "load_source",
    "register",
]

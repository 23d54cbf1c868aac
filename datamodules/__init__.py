"""Federated datamodules, partitioners and dataset sources."""

from datamodules.augment import ColorPerturbation
from datamodules.federated import FederatedDataModule, RoundPlans
from datamodules.partition import IID, Contiguous, Dirichlet, NaturalPartition, Partitioner, QuantitySkew, Shards
from datamodules.sources import SOURCES, DataSource, load_source, register
from datamodules.text import TASKS, TextDataModule
from datamodules.instruction import InstructionDataModule
from datamodules.vision import SPECS, VisionDataModule
from datamodules import binary  # noqa: F401,E402  (registers binary_digits, binary_mnist)

__all__ = [
    "IID",
    "Contiguous",
    "SOURCES",
    "SPECS",
    "ColorPerturbation",
    "DataSource",
    "Dirichlet",
    "FederatedDataModule",
    "InstructionDataModule",
    "NaturalPartition",
    "Partitioner",
    "QuantitySkew",
    "RoundPlans",
    "Shards",
    "TASKS",
    "TextDataModule",
    "VisionDataModule",
    "load_source",
    "register",
]

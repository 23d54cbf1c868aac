"""Federated datamodules, partitioners and dataset sources."""

import fl_lightning  # noqa: F401,I001  (first: in a checkout, the old name `datamodules` is then fl_lightning.datamodules itself)

from .augment import ColorPerturbation
from .federated import FederatedDataModule, RoundPlans
from .flwr_partition import FlwrPartition
from .partition import IID, Contiguous, Dirichlet, NaturalPartition, Partitioner, QuantitySkew, Shards
from .sources import SOURCES, DataSource, load_source, register
from .text import TASKS, TextDataModule
from .instruction import InstructionDataModule
from .leaf_module import LeafDataModule
from .vision import SPECS, VisionDataModule
from . import binary  # noqa: F401,E402  (registers binary_digits, binary_mnist)

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
    "LeafDataModule",
    "FlwrPartition",
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

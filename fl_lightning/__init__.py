"""fl-lightning: federated optimization on PyTorch Lightning."""

from typing import TYPE_CHECKING

from fl_lightning.algorithms import Algorithm, FedAvg
from fl_lightning.config import LocalTraining
from fl_lightning.participation import Participation, RoundPlan, UniformSampling
from fl_lightning.state import ClientStore

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule

__all__ = [
    "Algorithm",
    "ClientStore",
    "FedAvg",
    "FederatedModule",
    "LocalTraining",
    "Participation",
    "RoundPlan",
    "UniformSampling",
]


def __getattr__(name: str):
    """``FederatedModule`` is imported on first use: no engine component depends on the LightningModule."""
    if name == "FederatedModule":
        from fl_lightning.module import FederatedModule

        return FederatedModule
    raise AttributeError(f"module 'fl_lightning' has no attribute {name!r}")

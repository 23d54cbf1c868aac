"""fl-lightning: federated optimization on PyTorch Lightning."""

from fl_lightning.algorithms import Algorithm, FedAvg
from fl_lightning.config import LocalTraining
from fl_lightning.module import FederatedModule
from fl_lightning.participation import Participation, RoundPlan, UniformSampling
from fl_lightning.state import ClientStore

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

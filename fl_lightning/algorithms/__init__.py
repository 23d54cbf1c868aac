"""Federated algorithms, one small file each."""

from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedavg_p import FedAlt, FedAvgP, FedSim
from fl_lightning.algorithms.scaffold_p import ScaffoldP

__all__ = [
    "Algorithm",
    "ClientContext",
    "ClientResult",
    "FedAlt",
    "FedAvg",
    "FedAvgP",
    "FedSim",
    "Payload",
    "RoundInfo",
    "ScaffoldP",
]

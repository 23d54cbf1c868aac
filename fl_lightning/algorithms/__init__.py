"""Federated algorithms, one small file each."""

from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.algorithms.fadam import FAdamET, FAdamGT
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedlada import FedLADA
from fl_lightning.algorithms.local_adam import LocalAdam

__all__ = [
    "Algorithm",
    "ClientContext",
    "ClientResult",
    "FAdamET",
    "FAdamGT",
    "FedAvg",
    "FedLADA",
    "LocalAdam",
    "Payload",
    "RoundInfo",
]

"""Federated algorithms, one small file each."""

from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedavg_svrg import FedAvgSVRG

__all__ = ["Algorithm", "ClientContext", "ClientResult", "FedAvg", "FedAvgSVRG", "Payload", "RoundInfo"]

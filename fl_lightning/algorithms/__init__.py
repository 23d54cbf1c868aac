"""Federated algorithms, one small file each: the client and server rules (base: ``Algorithm``).

May import: core, optim.
"""

from fl_lightning.algorithms.afl import AFL
from fl_lightning.algorithms.apfl import APFL
from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.algorithms.ditto import Ditto
from fl_lightning.algorithms.fadam import FAdamET, FAdamGT
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedavg_svrg import FedAvgSVRG
from fl_lightning.algorithms.fedavg_p import FedAlt, FedAvgP, FedSim
from fl_lightning.algorithms.fedala import FedALA
from fl_lightning.algorithms.fedbabu import FedBABU
from fl_lightning.algorithms.fedcm import FedCM
from fl_lightning.algorithms.feddecorr import FedDecorr
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.fedlc import FedLC
from fl_lightning.algorithms.fedntd import FedNTD
from fl_lightning.algorithms.fedrod import FedRoD
from fl_lightning.algorithms.fedrs import FedRS
from fl_lightning.algorithms.fedexp import FedExP
from fl_lightning.algorithms.fedfv import FedFV
from fl_lightning.algorithms.fedlada import FedLADA
from fl_lightning.algorithms.fedmgda import FedMGDAPlus
from fl_lightning.algorithms.fedmim import FedMIM
from fl_lightning.algorithms.fednova import FedNova
from fl_lightning.algorithms.fedopt import FedAdam, FedAvgM, FedYogi
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedproto import FedProto
from fl_lightning.algorithms.fedsam import FedSAM
from fl_lightning.algorithms.local_adam import LocalAdam
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.pfedme import PFedMe
from fl_lightning.algorithms.perfedavg import PerFedAvg
from fl_lightning.algorithms.propfair import PropFair
from fl_lightning.algorithms.qffl import QFFL
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.algorithms.scaffold_p import ScaffoldP
from fl_lightning.algorithms.term import TERM

__all__ = [
    "AFL",
    "APFL",
    "MOON",
    "SCAFFOLD",
    "TERM",
    "Algorithm",
    "ClientContext",
    "ClientResult",
    "Ditto",
    "FAdamET",
    "FAdamGT",
    "FedALA",
    "FedAdam",
    "FedAlt",
    "FedAvg",
    "FedAvgM",
    "FedAvgSVRG",
    "FedAvgP",
    "FedBABU",
    "FedCM",
    "FedDecorr",
    "FedDyn",
    "FedExP",
    "FedFV",
    "FedLADA",
    "FedLC",
    "FedMGDAPlus",
    "FedMIM",
    "FedNTD",
    "FedNova",
    "FedProto",
    "FedProx",
    "FedRoD",
    "FedRS",
    "FedSAM",
    "FedSim",
    "FedYogi",
    "LocalAdam",
    "Payload",
    "PFedMe",
    "PerFedAvg",
    "PropFair",
    "QFFL",
    "RoundInfo",
    "ScaffoldP",
]

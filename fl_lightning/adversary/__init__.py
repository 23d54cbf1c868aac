"""Attacks on federated training (docs/robustness.md, "Attacks"; docs/algorithms.md, 26.2): a seeded fixed set
of malicious clients that poison their data or their uploads.

May import: core, algorithms, executors, pipeline.
"""

from __future__ import annotations

from fl_lightning.adversary.alie import ALIE
from fl_lightning.adversary.attack import Attack
from fl_lightning.adversary.backdoor import Backdoor
from fl_lightning.adversary.base import DataPoisoning, RoundView, UploadAttack
from fl_lightning.adversary.gaussian import GaussianUpload
from fl_lightning.adversary.ipm import IPM
from fl_lightning.adversary.label_flip import LabelFlip
from fl_lightning.adversary.malicious import MaliciousClients, choose_malicious
from fl_lightning.adversary.min_max import MinMax
from fl_lightning.adversary.min_sum import MinSum
from fl_lightning.adversary.scaling import ModelReplacement
from fl_lightning.adversary.sign_flip import SignFlip

__all__ = [
    "ALIE", "Attack", "Backdoor", "DataPoisoning", "GaussianUpload", "IPM", "LabelFlip", "MaliciousClients", "MinMax", "MinSum",
    "ModelReplacement", "RoundView", "SignFlip", "UploadAttack", "choose_malicious",
]  # fmt: skip

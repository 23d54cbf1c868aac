"""Plain nn.Module builders; models never see federation."""

import fl_lightning  # noqa: F401,I001  (first: in a checkout, the old name `models` is then fl_lightning.models itself)

from .cnn import SmallCNN
from .fedavg_cnn import FedAvgCNN
from .causal_lm_lora import LoRACausalLM
from .gpt2_lora import LoRAClassifier
from .least_squares import LinearLeastSquares
from .linear import LinearRegression
from .mlp import MLP
from .resnet import ResNet18, ResNet18x64
from .split_logistic import SplitLogistic

__all__ = [
    "MLP",
    "FedAvgCNN",
    "LinearLeastSquares",
    "LinearRegression",
    "LoRACausalLM",
    "LoRAClassifier",
    "ResNet18",
    "ResNet18x64",
    "SmallCNN",
    "SplitLogistic",
]

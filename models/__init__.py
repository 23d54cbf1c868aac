"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.fedavg_cnn import FedAvgCNN
from models.causal_lm_lora import LoRACausalLM
from models.gpt2_lora import LoRAClassifier
from models.least_squares import LinearLeastSquares
from models.linear import LinearRegression
from models.mlp import MLP
from models.resnet import ResNet18, ResNet18x64
from models.split_logistic import SplitLogistic

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

"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.fedavg_cnn import FedAvgCNN
from models.mlp import MLP
from models.resnet import ResNet18, ResNet18x64

__all__ = ["MLP", "FedAvgCNN", "ResNet18", "ResNet18x64", "SmallCNN"]

"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.fedavg_cnn import FedAvgCNN
from models.linear import LinearRegression
from models.mlp import MLP
from models.resnet import ResNet18, ResNet18x64
from models.split_logistic import SplitLogistic

__all__ = ["MLP", "FedAvgCNN", "LinearRegression", "ResNet18", "ResNet18x64", "SmallCNN", "SplitLogistic"]

"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.mlp import MLP
from models.split_logistic import SplitLogistic

__all__ = ["MLP", "SmallCNN", "SplitLogistic"]

"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.least_squares import LinearLeastSquares
from models.linear import LinearRegression
from models.mlp import MLP

__all__ = ["MLP", "LinearLeastSquares", "LinearRegression", "SmallCNN"]

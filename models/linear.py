"""Linear regression with its own squared loss (for least-squares problems with known optima)."""

from __future__ import annotations

from torch import Tensor, nn


class LinearRegression(nn.Module):
    """``y = w^T x + b``; ``loss(out, y) = 0.5 * mean((out - y)^2)`` (used instead of cross-entropy).

    Args:
        in_features: input size, >= 1.
        out_features: output size, >= 1 (targets of shape [n] go with out_features = 1).
    """

    def __init__(self, in_features: int, out_features: int = 1) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"LinearRegression needs in_features >= 1 and out_features >= 1, got {in_features}, {out_features}")
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)

    # The representation convention (docs/architecture.md): the representation of a linear model is its input.
    def representation(self, x: Tensor) -> Tensor:
        return x

    def head(self, z: Tensor) -> Tensor:
        return self.linear(z)

    @staticmethod
    def loss(out: Tensor, y: Tensor) -> Tensor:
        return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()

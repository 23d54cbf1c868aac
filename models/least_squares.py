"""Linear least squares y ~ q theta with a chosen starting point (Rostami & Kia, Sec. VI)."""

from __future__ import annotations

import torch
from torch import nn

from .linear import LinearRegression


class LinearLeastSquares(LinearRegression):
    """``LinearRegression`` with an optional bias and every parameter initialised to ``init``.

    The paper's model is theta in R^d without bias, started at theta^0 = 0.5 * 1.

    Args:
        in_features: d, >= 1.
        out_features: >= 1.
        bias: add an intercept.
        init: the starting value of every parameter; ``None`` keeps nn.Linear's random init.
    """

    def __init__(self, in_features: int, out_features: int = 1, bias: bool = False, init: float | None = 0.5) -> None:
        super().__init__(in_features, out_features)
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        if init is not None:
            with torch.no_grad():
                for p in self.linear.parameters():
                    p.fill_(init)

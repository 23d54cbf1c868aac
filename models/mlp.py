"""Multi-layer perceptron on flattened inputs."""

from __future__ import annotations

from torch import Tensor, nn


class MLP(nn.Module):
    """``in_features -> hidden... -> num_classes`` with ReLU; inputs are flattened first.

    Args:
        in_features: size of a flattened input (64 for 8x8 digits).
        num_classes: number of outputs.
        hidden: widths of the hidden layers (empty: a linear model).
    """

    # Each sample's output depends on that sample alone: batched execution runs the clients'
    # batches as rows of one batch (``fl_lightning.core.client_rows``).
    independent_rows = True

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: list[int] | None = None) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 1:
            raise ValueError(f"MLP needs in_features >= 1 and num_classes >= 1, got {in_features}, {num_classes}")
        widths = [in_features, *(hidden if hidden is not None else [64]), num_classes]
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    # The representation convention (docs/architecture.md): forward(x) = head(representation(x)).
    def representation(self, x: Tensor) -> Tensor:
        """The last hidden layer's activations (the flattened input for a linear model)."""
        for layer in self.net[:-1]:
            x = layer(x)
        return x

    def head(self, z: Tensor) -> Tensor:
        return self.net[-1](z)

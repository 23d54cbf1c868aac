"""The CNN of McMahan et al. 2017 (FedAvg paper, "CNN" on MNIST)."""

from __future__ import annotations

from torch import Tensor, nn


class FedAvgCNN(nn.Module):
    """conv5x5(32) - ReLU - maxpool2 - conv5x5(64) - ReLU - maxpool2 - linear(512) - ReLU - linear(classes).

    "Same" padding, so a 28x28 MNIST input gives 7x7x64 features and the model
    has 1,663,370 parameters, the count reported by McMahan et al. 2017.

    Args:
        in_channels: image channels (1 for MNIST, 3 for CIFAR).
        num_classes: outputs.
        image_size: side of the square input, a multiple of 4.
    """

    # Each sample's output depends on that sample alone: batched execution runs the clients'
    # batches as rows of one batch (``fl_lightning.core.client_rows``).
    independent_rows = True

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        if image_size < 4 or image_size % 4:
            raise ValueError(f"FedAvgCNN image_size must be a multiple of 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * (image_size // 4) ** 2, 512), nn.ReLU(), nn.Linear(512, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    # The representation convention (docs/architecture.md): forward(x) = head(representation(x)).
    def representation(self, x: Tensor) -> Tensor:
        """The hidden linear layer's activations (after its ReLU), which the last layer reads."""
        return self.classifier[1](self.classifier[0](self.features(x)))

    def head(self, z: Tensor) -> Tensor:
        return self.classifier[2](z)

"""Small convolutional network for small images (e.g. 8x8 digits)."""

from __future__ import annotations

from torch import Tensor, nn


class SmallCNN(nn.Module):
    """conv3x3(c) - ReLU - conv3x3(2c) - ReLU - maxpool2 - linear(hidden) - ReLU - linear(classes).

    Args:
        in_channels: image channels.
        num_classes: number of outputs.
        image_size: side of the square input (8 for digits).
        channels: width c of the first convolution.
        hidden: width of the hidden linear layer.
    """

    # Each sample's output depends on that sample alone: batched execution runs the clients'
    # batches as rows of one batch (``fl_lightning.core.client_rows``).
    independent_rows = True

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, channels: int = 16, hidden: int = 64
    ) -> None:
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"SmallCNN image_size must be an even number >= 2, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(2 * channels * (image_size // 2) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    # The representation convention (docs/architecture.md): forward(x) = head(representation(x)).
    def representation(self, x: Tensor) -> Tensor:
        """The hidden linear layer's activations (after its ReLU), which the last layer reads."""
        return self.classifier[1](self.classifier[0](self.features(x)))

    def head(self, z: Tensor) -> Tensor:
        return self.classifier[2](z)

"""Small convolutional network for small images (e.g. 8x8 digits)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from torch import Tensor, nn

CNNNorm = Literal["none", "group", "batch_nostats"]


class SmallCNN(nn.Module):
    """conv3x3(c) - [norm] - ReLU - conv3x3(2c) - [norm] - ReLU - maxpool2 - linear(hidden) - ReLU - linear(classes).

    Args:
        in_channels: image channels.
        num_classes: number of outputs.
        image_size: side of the square input (8 for digits).
        channels: width c of the first convolution.
        hidden: width of the hidden linear layer.
        norm: a normalization after each convolution: ``"none"`` (default: the network above without
            norm layers, its parameters, names and initialisation unchanged), ``"group"`` (GroupNorm with
            2 groups; ``channels`` even) or ``"batch_nostats"`` (BatchNorm without running statistics:
            batch statistics in training and in evaluation alike, so no buffers). The norm layers are
            ``features.norm0`` and ``features.norm2`` (after the convolutions ``features.0`` and
            ``features.2``); their affine parameters are ``features.norm*.weight``/``.bias`` (FedBN keeps
            them personal with ``personal: ["*norm*"]``).
    """

    # Each sample's output depends on that sample alone: batched execution runs the clients'
    # batches as rows of one batch (``fl_lightning.core.client_rows``). With ``norm="batch_nostats"``
    # the instance says otherwise (batch statistics mix the rows).
    independent_rows = True

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, channels: int = 16, hidden: int = 64,
        norm: CNNNorm = "none",
    ) -> None:  # fmt: skip
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"SmallCNN image_size must be an even number >= 2, got {image_size}")
        if norm not in ("none", "group", "batch_nostats"):
            raise ValueError(f"SmallCNN norm must be 'none', 'group' or 'batch_nostats', got {norm!r}")
        if norm == "group" and channels % 2:
            raise ValueError(f"SmallCNN norm 'group' (2 groups) needs an even number of channels, got {channels}")
        layers: list[tuple[str, nn.Module]] = [
            ("0", nn.Conv2d(in_channels, channels, 3, padding=1)),
            ("norm0", _norm(norm, channels)),
            ("1", nn.ReLU()),
            ("2", nn.Conv2d(channels, 2 * channels, 3, padding=1)),
            ("norm2", _norm(norm, 2 * channels)),
            ("3", nn.ReLU()),
            ("4", nn.MaxPool2d(2)),
            ("5", nn.Flatten()),
        ]
        self.features = nn.Sequential(OrderedDict((name, layer) for name, layer in layers if layer is not None))
        self.classifier = nn.Sequential(
            nn.Linear(2 * channels * (image_size // 2) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )
        if norm == "batch_nostats":
            self.independent_rows = False

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    # The representation convention (docs/architecture.md): forward(x) = head(representation(x)).
    def representation(self, x: Tensor) -> Tensor:
        """The hidden linear layer's activations (after its ReLU), which the last layer reads."""
        return self.classifier[1](self.classifier[0](self.features(x)))

    def head(self, z: Tensor) -> Tensor:
        return self.classifier[2](z)


def _norm(norm: CNNNorm, channels: int) -> nn.Module | None:
    if norm == "group":
        return nn.GroupNorm(2, channels)
    if norm == "batch_nostats":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    return None

"""ResNet-18 for small images (He et al. 2016), in the CIFAR variant used by FL papers.

CIFAR variant: a 3x3 stride-1 stem and no max-pool (a 32x32 input keeps 32x32
maps in stage 1), four stages of two BasicBlocks (64, 128, 256, 512 channels),
global average pooling, one linear layer: 11,173,962 parameters for 10 classes.

Normalization: GroupNorm (default, 2 groups as in Hsieh et al. 2020) or BatchNorm.
BatchNorm caveat in this engine: the running mean/variance are *buffers*, not
parameters, so they are not federated. All simulated clients share the one
module, and during local training (train mode) every client's batches update
the same running statistics in place, in the order the clients are run. They
are never averaged, never sent (not counted in bytes), not part of any
client state, and evaluation uses whatever the last few clients' batches left
there (momentum 0.1: roughly the last 10-20 batches). Under label skew this
makes evaluation of a BatchNorm model noisy and biased towards the last
clients; GroupNorm has no running statistics and none of this. The buffers are
in the model's state_dict, so they are checkpointed and resume exactly.
``norm="batch_nostats"`` (BatchNorm with ``track_running_stats=False``) uses batch
statistics in evaluation too, which removes the problem at the cost of
batch-dependent predictions.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

Norm = Literal["group", "batch", "batch_nostats"]


def make_norm(norm: Norm, channels: int, num_groups: int) -> nn.Module:
    if norm == "group":
        return nn.GroupNorm(num_groups, channels)
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "batch_nostats":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    raise ValueError(f"norm must be 'group', 'batch' or 'batch_nostats', got {norm!r}")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (1x1 projection when the shape changes)."""

    def __init__(self, in_planes: int, planes: int, stride: int, norm: Norm, num_groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = make_norm(norm, planes, num_groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = make_norm(norm, planes, num_groups)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), make_norm(norm, planes, num_groups)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant (3x3 stem, no max-pool); any input size (adaptive pooling).

    Args:
        num_classes: outputs.
        in_channels: image channels (3; 1 for MNIST).
        norm: ``"group"`` (default), ``"batch"`` or ``"batch_nostats"`` (see module docstring).
        num_groups: GroupNorm groups; must divide 64.
        stem_stride: stride of the 3x3 stem: 1 for 32x32 inputs; 2 halves a 64x64
            input so that the network costs what it costs on CIFAR.
        channels_last: keep weights and activations channels-last (NHWC), the layout fast
            convolution kernels want on GPUs (bf16/fp16 tensor cores) and recent CPUs; the
            results are the same to float tolerance.
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 3, norm: Norm = "group", num_groups: int = 2, stem_stride: int = 1,
        channels_last: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"ResNet18 needs num_classes >= 1 and in_channels >= 1, got {num_classes}, {in_channels}")
        if norm == "group" and (num_groups < 1 or 64 % num_groups):
            raise ValueError(f"ResNet18 num_groups must divide 64, got {num_groups}")
        if stem_stride not in (1, 2):
            raise ValueError(f"ResNet18 stem_stride must be 1 or 2, got {stem_stride}")
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=stem_stride, padding=1, bias=False)
        self.bn1 = make_norm(norm, 64, num_groups)
        self.relu = nn.ReLU()
        layers, in_planes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(
                nn.Sequential(
                    BasicBlock(in_planes, planes, stride, norm, num_groups), BasicBlock(planes, planes, 1, norm, num_groups)
                )
            )
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        self.channels_last = channels_last
        # GroupNorm normalises each sample alone, so batched execution can run the clients' batches
        # as rows of one batch (``fl_lightning.core.client_rows``); BatchNorm's batch statistics mix them.
        self.independent_rows = norm == "group"
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.representation(x))

    # The representation convention (docs/architecture.md): forward(x) = head(representation(x)).
    def representation(self, x: Tensor) -> Tensor:
        """The globally pooled 512 features of the last stage, which ``fc`` reads."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.pool(out).flatten(1)

    def head(self, z: Tensor) -> Tensor:
        return self.fc(z)


class ResNet18x64(ResNet18):
    """ResNet-18 for 64x64 inputs (TinyImageNet, 200 classes).

    Same layers as :class:`ResNet18`; by default the stem has stride 2 so the
    stages see 32x32, 16x16, 8x8, 4x4 maps, as on CIFAR (same FLOPs per image).
    ``stem_stride=1`` keeps full resolution (about 4x the compute).
    """

    def __init__(
        self, num_classes: int = 200, in_channels: int = 3, norm: Norm = "group", num_groups: int = 2, stem_stride: int = 2,
        channels_last: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(num_classes, in_channels, norm, num_groups, stem_stride, channels_last)

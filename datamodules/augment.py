"""Image batch transforms in plain torch (no torchvision), deterministic from a generator.

All functions take a float batch ``[B, C, H, W]`` with values in [0, 1] (except
``normalize``'s output) and draw their randomness from an explicit
``torch.Generator``, so a client's augmentation is fixed by (seed, round, client).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.core.participation import derive_seed

_COLOR_STREAM = 0xC010


def to_unit_float(images: Tensor) -> Tensor:
    """uint8 ``[B, C, H, W]`` in 0..255 -> float32 in [0, 1]."""
    return images.float().div_(255.0)


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel ``(x - mean) / std``."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def random_crop(x: Tensor, padding: int, generator: torch.Generator) -> Tensor:
    """Zero-pad by ``padding`` on each side, then crop back to ``H x W`` at a random offset per image."""
    if padding <= 0:
        return x
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # [B, 1, H, 1]
    cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # [B, 1, 1, W]
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]


def random_hflip(x: Tensor, generator: torch.Generator, p: float = 0.5) -> Tensor:
    """Mirror each image left-right with probability ``p``."""
    flip = torch.rand(x.shape[0], generator=generator) < p
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def adjust_brightness(x: Tensor, factor: Tensor | float) -> Tensor:
    """``clamp(factor * x, 0, 1)`` (torchvision's adjust_brightness)."""
    return (x * factor).clamp_(0.0, 1.0)


def adjust_saturation(x: Tensor, factor: Tensor | float) -> Tensor:
    """Blend with the ITU-R 601 grey image: factor 0 is grey, 1 unchanged, > 1 more saturated.

    Single-channel images have no saturation and are returned unchanged.
    """
    if x.shape[1] != 3:
        return x
    grey = (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).expand_as(x)
    return (factor * x + (1.0 - factor) * grey).clamp_(0.0, 1.0)


class ColorPerturbation:
    """Client-specific colour shift (FedMIM, Liu et al., Sec. V-A, after Arjovsky et al. 2019).

    Client ``i`` gets one brightness factor ``b_i ~ U[1 - brightness, 1 + brightness]``
    and one saturation factor ``s_i ~ U[1 - saturation, 1 + saturation]``, drawn
    once from ``(seed, i)`` (the same in every round), and all its images are
    ``adjust_saturation(adjust_brightness(x, b_i), s_i)``: a feature shift
    strongly correlated with the client. The paper gives no ranges; the defaults
    here are our choice.

    Args:
        brightness: half-width of the brightness range, in [0, 1).
        saturation: half-width of the saturation range, in [0, 1].
    """

    def __init__(self, brightness: float = 0.4, saturation: float = 0.6) -> None:
        if not 0.0 <= brightness < 1.0:
            raise ValueError(f"ColorPerturbation brightness must be in [0, 1), got {brightness}")
        if not 0.0 <= saturation <= 1.0:
            raise ValueError(f"ColorPerturbation saturation must be in [0, 1], got {saturation}")
        self.brightness, self.saturation = brightness, saturation

    def factors(self, client_id: int, seed: int) -> tuple[float, float]:
        """``(b_i, s_i)`` of client ``client_id``."""
        g = torch.Generator().manual_seed(derive_seed(seed, client_id, _COLOR_STREAM))
        u = torch.rand(2, generator=g, dtype=torch.float64)
        b = 1.0 + self.brightness * (2.0 * float(u[0]) - 1.0)
        s = 1.0 + self.saturation * (2.0 * float(u[1]) - 1.0)
        return b, s

    def __call__(self, x: Tensor, client_id: int, seed: int) -> Tensor:
        b, s = self.factors(client_id, seed)
        return adjust_saturation(adjust_brightness(x, b), s)

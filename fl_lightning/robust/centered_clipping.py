"""Centered clipping (Karimireddy, He and Jaggi, ICML 2021), docs/algorithms.md (26.1.7)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule


def clip(Z: Tensor, tau: float) -> Tensor:
    """Each row scaled to norm at most tau."""
    norms = torch.linalg.vector_norm(Z, dim=1, keepdim=True)
    return Z * torch.clamp(tau / torch.clamp(norms, min=torch.finfo(Z.dtype).tiny), max=1.0)


class CenteredClipping(RobustRule):
    """v <- v + (1/n) sum_i clip_tau(V_i - v), ``iters`` times, from the center v = the previous
    round's output (zero at the start): server state, checkpointed. Needs f < n / 2."""

    name = "centered_clipping"
    needs_majority = True

    def __init__(self, tau: float = 1.0, iters: int = 1) -> None:
        if not tau > 0:
            raise ValueError(f"robust.tau must be > 0, got {tau}")
        if iters < 1:
            raise ValueError(f"robust.iters must be an integer >= 1, got {iters}")
        self.tau, self.iters = tau, iters
        self.center: Tensor | None = None

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        v = torch.zeros_like(V[0]) if self.center is None else self.center.to(V)
        for _ in range(self.iters):
            v = v + clip(V - v, self.tau).mean(dim=0)
        self.center = v.detach().clone()
        return Combined(v)

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.center is None else {"center": self.center.cpu()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.center = state.get("center")

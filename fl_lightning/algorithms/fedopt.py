"""Server optimizers on the pseudo-gradient d = -sum_i w_i (x_i - x) (Reddi et al. 2021, Alg. 2; Hsu et al. 2019).

Rules: docs/algorithms.md, section 9, (9.1)-(9.3); first step E4.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.optim import Yogi


def _check_betas(name: str, betas: tuple[float, float]) -> tuple[float, float]:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name} betas must be two values in [0, 1), got {betas}")
    return float(betas[0]), float(betas[1])


class FedAdam(FedAvg):
    """Local SGD; the server applies ``torch.optim.Adam`` (lr = global_lr, eps = tau) to d.

    torch's Adam bias-corrects both moments (Reddi et al.'s Alg. 2 does not).

    Args:
        global_lr: server lr eta (> 0).
        betas: (beta1, beta2) in [0, 1).
        tau: adaptivity eps, > 0.
    """

    def __init__(self, global_lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99), tau: float = 1e-3) -> None:
        super().__init__(global_lr)
        self.betas = _check_betas("FedAdam", betas)
        if not tau > 0:
            raise ValueError(f"FedAdam tau must be > 0, got {tau}")
        self.tau = tau

    def server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.global_lr, betas=self.betas, eps=self.tau)


class FedYogi(FedAdam):
    """FedAdam with Yogi's additive second moment (``fl_lightning.optim.Yogi``)."""

    def server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return Yogi(params, lr=self.global_lr, betas=self.betas, eps=self.tau)


class FedAvgM(FedAvg):
    """Local SGD; the server applies heavy-ball momentum: m <- beta m + d, x <- x - eta_g m (``torch.optim.SGD``).

    Args:
        global_lr: server lr eta_g (> 0).
        momentum: beta in [0, 1) (0 is FedAvg).
        nesterov: Nesterov momentum.
    """

    def __init__(self, global_lr: float = 1.0, momentum: float = 0.9, nesterov: bool = False) -> None:
        super().__init__(global_lr)
        if not 0 <= momentum < 1:
            raise ValueError(f"FedAvgM momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("FedAvgM nesterov=True needs momentum > 0")
        self.momentum, self.nesterov = momentum, nesterov

    def server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.global_lr, momentum=self.momentum, nesterov=self.nesterov)

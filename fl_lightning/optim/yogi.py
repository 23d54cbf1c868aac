"""Yogi (Zaheer et al. 2018, Alg. 2) as a torch.optim.Optimizer, for FedYogi's server step (docs/algorithms.md, (9.2)).

torch has no Yogi. This one mirrors ``torch.optim.Adam`` (zero-initialised moments,
bias correction) and differs only in the second moment, which moves additively:
``v <- v - (1 - beta2) * sign(v - g^2) * g^2`` instead of Adam's ``beta2 * v + (1 - beta2) * g^2``.
"""

from __future__ import annotations

import torch


class Yogi(torch.optim.Optimizer):
    """Args: lr (> 0), betas (each in [0, 1)), eps (> 0; FedYogi's tau)."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-3) -> None:
        if not lr > 0:
            raise ValueError(f"Yogi lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Yogi betas must be in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"Yogi eps must be > 0, got {eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g2 = g * g
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.sub_((1 - beta2) * torch.sign(v - g2) * g2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                p.sub_(group["lr"] * m_hat / (v_hat.sqrt() + group["eps"]))
        return loss

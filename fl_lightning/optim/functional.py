"""The server optimizers' steps as pure functions, for the compiled round (``fl_lightning/executors/round_program.py``):
``step(params, grads, state) -> (params, state)`` with the arithmetic of ``torch.optim.SGD``, ``torch.optim.Adam``
and ``fl_lightning.optim.Yogi`` (docs/algorithms.md (9.1)-(9.2)), so that a compiled round equals the eager one to
float tolerance and writes back the optimizer state torch.optim would hold (a checkpoint of either resumes under the
other). ``functional_step`` names an optimizer it cannot express (one line) instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fl_lightning.optim.yogi import Yogi

State = dict[str, list[Tensor]]
"""Per-parameter state tensors by name (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), in parameter order."""


def sgd(params: list[Tensor], grads: list[Tensor], state: State, lr: float, momentum: float, nesterov: bool) -> tuple[list[Tensor], State]:
    """``torch.optim.SGD`` (no weight decay or dampening): b <- mu b + g (b = g at the first step: mu * 0 + g is g
    exactly), d = g + mu b (Nesterov) or b, p <- p - lr d."""
    if momentum == 0:
        return [p - lr * g for p, g in zip(params, grads)], state
    buffers = [momentum * b + g for b, g in zip(state["momentum_buffer"], grads)]
    steps = [g + momentum * b for g, b in zip(grads, buffers)] if nesterov else buffers
    return [p - lr * d for p, d in zip(params, steps)], {"momentum_buffer": buffers}


def adam(params: list[Tensor], grads: list[Tensor], state: State, lr: float, betas: tuple[float, float], eps: float) -> tuple[list[Tensor], State]:
    """``torch.optim.Adam`` (no weight decay, amsgrad or maximize): m <- m + (1 - b1)(g - m), v <- b2 v + (1 - b2) g^2,
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""
    beta1, beta2 = betas
    steps = [s + 1 for s in state["step"]]
    out: State = {"step": steps, "exp_avg": [], "exp_avg_sq": []}
    new = []
    for p, g, m, v, t in zip(params, grads, state["exp_avg"], state["exp_avg_sq"], steps):
        m = torch.lerp(m, g, 1 - beta1)
        v = v * beta2 + (1 - beta2) * g * g
        t64 = t.double()
        step_size = (lr / (1 - beta1**t64)).to(p.dtype)
        denom = v.sqrt() / torch.sqrt(1 - beta2**t64).to(p.dtype) + eps
        new.append(p - step_size * m / denom)
        out["exp_avg"].append(m)
        out["exp_avg_sq"].append(v)
    return new, out


def yogi(params: list[Tensor], grads: list[Tensor], state: State, lr: float, betas: tuple[float, float], eps: float) -> tuple[list[Tensor], State]:
    """``fl_lightning.optim.Yogi``: Adam's first moment, v <- v - (1 - b2) sign(v - g^2) g^2, both bias-corrected."""
    beta1, beta2 = betas
    steps = [s + 1 for s in state["step"]]
    out: State = {"step": steps, "exp_avg": [], "exp_avg_sq": []}
    new = []
    for p, g, m, v, t in zip(params, grads, state["exp_avg"], state["exp_avg_sq"], steps):
        g2 = g * g
        m = m * beta1 + (1 - beta1) * g
        v = v - (1 - beta2) * torch.sign(v - g2) * g2
        m_hat, v_hat = m / (1 - beta1**t).to(p.dtype), v / (1 - beta2**t).to(p.dtype)
        new.append(p - lr * m_hat / (v_hat.sqrt() + eps))
        out["exp_avg"].append(m)
        out["exp_avg_sq"].append(v)
    return new, out


@dataclass
class FunctionalStep:
    """An optimizer's step as a pure function, its state read from and written back to the optimizer."""

    optimizer: torch.optim.Optimizer
    step: Callable[..., tuple[list[Tensor], State]]
    names: tuple[str, ...]  # the per-parameter state entries
    init: Callable[[Tensor], dict[str, Tensor]]

    def params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state(self) -> State:
        """The optimizer's state as the step reads it (initialised as torch.optim would at its first step)."""
        per_param = [self.optimizer.state.get(p) or self.init(p) for p in self.params()]
        return {name: [s[name] for s in per_param] for name in self.names}

    def write(self, new_params: list[Tensor], new_state: State) -> None:
        """Copy the step's parameters into the live ones and its state into the optimizer's (torch.optim's layout)."""
        with torch.no_grad():
            for i, p in enumerate(self.params()):
                p.copy_(new_params[i])
                own = self.optimizer.state[p]
                for name in self.names:
                    value = new_state[name][i].detach()
                    if isinstance(own.get(name), Tensor) and own[name].shape == value.shape and own[name].dtype == value.dtype:
                        own[name].copy_(value)
                    else:
                        own[name] = value.clone()


def functional_step(optimizer: Any) -> FunctionalStep | str:
    """The optimizer's pure step, or why it has none (one line)."""
    if len(getattr(optimizer, "param_groups", ())) != 1:
        return f"the server optimizer {type(optimizer).__name__} has {len(optimizer.param_groups)} parameter groups"
    group, kind = optimizer.param_groups[0], type(optimizer)
    unsupported = [k for k in ("weight_decay", "dampening", "maximize", "amsgrad", "differentiable", "capturable") if group.get(k)]
    if unsupported:
        return f"the server optimizer {kind.__name__} sets {unsupported[0]}"
    if kind is torch.optim.SGD:
        momentum = group["momentum"]
        names = ("momentum_buffer",) if momentum else ()
        return FunctionalStep(optimizer, lambda p, g, s: sgd(p, g, s, group["lr"], momentum, group["nesterov"]), names,
                              lambda p: {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)})  # fmt: skip
    if kind is torch.optim.Adam:
        return FunctionalStep(optimizer, lambda p, g, s: adam(p, g, s, group["lr"], group["betas"], group["eps"]), ("step", "exp_avg", "exp_avg_sq"),
                              lambda p: {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})  # fmt: skip
    if kind is Yogi:
        return FunctionalStep(optimizer, lambda p, g, s: yogi(p, g, s, group["lr"], group["betas"], group["eps"]), ("step", "exp_avg", "exp_avg_sq"),
                              lambda p: {"step": torch.zeros((), dtype=torch.float64), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})  # fmt: skip
    return f"the server optimizer {kind.__name__} has no functional form (SGD, Adam and Yogi have)"

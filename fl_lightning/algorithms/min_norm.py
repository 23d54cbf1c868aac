"""The min-norm combination of FedMGDA+ (docs/algorithms.md, section 30, (30.18)): the convex weights lambda with
each lambda_i within epsilon of 1/m that minimise ||sum_i lambda_i u_i||^2, from the Gram matrix of the u_i."""

from __future__ import annotations

import torch
from torch import Tensor

TOLERANCE = 1e-12
"""Steps below it (in any weight) end the search on a working set; multipliers above -it (scaled by the largest
gradient entry) count as optimal."""


def min_norm_weights(gram: Tensor, epsilon: float) -> Tensor:
    """argmin lambda^T G lambda over sum_i lambda_i = 1, max(0, 1/m - eps) <= lambda_i <= min(1, 1/m + eps), in float64.

    A primal active-set method (Nocedal & Wright, Numerical Optimization, Alg. 16.3) from the feasible uniform
    weights: each iteration solves the equality-constrained problem on the weights off their bounds (a least-squares
    solve of its KKT system, so a singular G is fine) and steps toward its solution until a bound blocks; at a
    working set's minimum, a bound whose multiplier has the wrong sign is released. Finite for a convex problem;
    the result is exact up to the linear solves' rounding (about 1e-15 for a well-conditioned G). eps = 0 or one
    client: the uniform weights, returned as they are.
    """
    m = gram.shape[0]
    lam = torch.full((m,), 1.0 / m, dtype=torch.float64)
    if epsilon == 0 or m == 1:
        return lam
    q = (gram.double() + gram.double().T) / 2
    lower, upper = max(0.0, 1.0 / m - epsilon), min(1.0, 1.0 / m + epsilon)
    side = torch.zeros(m, dtype=torch.int64)  # 0: free, -1: at its lower bound, +1: at its upper bound
    at_minimum = False
    for _ in range(20 * m + 100):
        free = (side == 0).nonzero().flatten()
        if not at_minimum:
            p = _equality_step(q, lam, side == 0) - lam[free]
            if p.abs().max() <= TOLERANCE:
                at_minimum = True
            else:
                lam, side, at_minimum = _advance(lam, side, free, p, lower, upper)
                continue
        grad = 2 * q @ lam
        residual = grad + (-grad[free].mean())  # g_i + nu: >= 0 at a lower bound, <= 0 at an upper one (KKT)
        wrong = torch.where(side < 0, -residual, torch.where(side > 0, residual, torch.zeros_like(residual)))
        worst = int(wrong.argmax())
        if not wrong[worst] > TOLERANCE * max(1.0, float(grad.abs().max())):
            return lam
        side[worst], at_minimum = 0, False
    raise RuntimeError(f"min_norm_weights: no optimum after {20 * m + 100} active-set iterations (m = {m}, epsilon = {epsilon})")


def _equality_step(q: Tensor, lam: Tensor, free: Tensor) -> Tensor:
    """The free weights minimising lambda^T Q lambda with the bound ones fixed and the weights summing to 1."""
    n = int(free.sum())
    kkt = torch.zeros((n + 1, n + 1), dtype=torch.float64)
    kkt[:n, :n] = 2 * q[free][:, free]
    kkt[:n, n] = kkt[n, :n] = 1.0
    rhs = torch.cat([-2 * q[free][:, ~free] @ lam[~free], (1.0 - lam[~free].sum()).reshape(1)])
    return torch.linalg.lstsq(kkt, rhs[:, None], driver="gelsd").solution[:n, 0]


def _advance(lam: Tensor, side: Tensor, free: Tensor, p: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor, bool]:
    """The longest step along p (at most 1) that keeps the free weights within their bounds; the bound that blocks
    it joins the working set. Returns the weights, the sides, and whether the full step (a minimum) was taken."""
    room = torch.where(p < 0, (lower - lam[free]) / p, torch.where(p > 0, (upper - lam[free]) / p, torch.full_like(p, torch.inf)))
    block = int(room.argmin())
    step = min(1.0, float(room[block]))
    lam = lam.clone()
    lam[free] = lam[free] + step * p
    if step >= 1.0:
        return lam, side, True
    i = int(free[block])
    side = side.clone()
    lam[i], side[i] = (lower, -1) if p[block] < 0 else (upper, 1)
    return lam, side, False

"""The correlated noise of DP-FTRL and banded matrix factorization (docs/algorithms.md section 32).

Both release C X + Z for the rounds' clipped sums X (rows x_t) and a strategy matrix C, and feed
the optimizer x_t + w_t, the noise w_t the t-th row of a linear map of Z (32.2):

* ``TreeNoise``: C is the binary tree of partial sums (Kairouz et al., ICML 2021); the prefix sum's
  noise is the sum of the noises of its dyadic nodes, read plainly or through Honaker's efficient
  estimator (32.4), and w_t is the difference of two consecutive prefix noises. State: the dyadic
  nodes' noise estimates, O(log T) vectors.
* ``BandedNoise``: C is lower-triangular banded Toeplitz with b coefficients (Choquette-Choo et al.,
  NeurIPS 2023), w = C^{-1} Z by forward substitution (32.5). State: the last b - 1 noise vectors.

``banded_toeplitz`` computes the coefficients (32.6); ``strategy_rows`` and ``sensitivities`` give the
sensitivity of the released prefix under a participation schedule (32.7).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

Draw = Callable[[int, int], Tensor]
"""``draw(height, first)``: the standard Gaussian vector of the tree node of ``height`` whose first leaf is round
``first``, or of round ``first`` (height 0)."""


def honaker_variances(heights: int) -> list[float]:
    """v_h of (32.4): the variance of the efficient estimate of a node at height h, per unit noise."""
    variances = [1.0]
    for _ in range(1, heights):
        variances.append(1.0 / (1.0 + 1.0 / (2.0 * variances[-1])))
    return variances


class TreeNoise:
    """The noise w_t of tree aggregation, one round at a time (32.3, 32.4); ``efficient``: Honaker's estimator;
    ``period``: a new tree every ``period`` rounds (Kairouz et al.'s restart per epoch; None: one tree)."""

    def __init__(self, draw: Draw, efficient: bool, period: int | None = None) -> None:
        self.draw, self.efficient, self.period = draw, efficient, period
        self.leaves = 0
        self.stack: list[tuple[int, int, Tensor]] = []  # (height, first leaf, noise estimate) of the prefix's dyadic nodes
        self.previous: Tensor | None = None  # the previous prefix's noise (None: a tree starts)

    def next(self) -> Tensor:
        if self.period is not None and self.leaves % self.period == 0:
            self.stack, self.previous = [], None
        height, first, estimate = 0, self.leaves, self.draw(0, self.leaves)
        while self.stack and self.stack[-1][0] == height:
            _, first, left = self.stack.pop()
            height += 1
            own = self.draw(height, first)
            if self.efficient:  # inverse-variance weights of the node's own noise and its children's estimates
                v = honaker_variances(height + 1)
                estimate = v[height] * (own + (left + estimate) / (2.0 * v[height - 1]))
            else:
                estimate = own
        self.stack.append((height, first, estimate))
        self.leaves += 1
        prefix = torch.stack([e for _, _, e in self.stack]).sum(0)
        noise = prefix if self.previous is None else prefix - self.previous
        self.previous = prefix
        return noise

    def state_dict(self) -> dict[str, Tensor]:
        nodes = torch.stack([e for _, _, e in self.stack]) if self.stack else torch.zeros(0)
        previous = self.previous if self.previous is not None else torch.zeros(0)
        keys = torch.tensor([[h, f] for h, f, _ in self.stack], dtype=torch.int64).reshape(-1, 2)
        return {"rounds": torch.tensor(self.leaves), "nodes_at": keys, "nodes": nodes, "previous": previous}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.leaves = int(state["rounds"])
        self.stack = [(int(h), int(f), e.clone()) for (h, f), e in zip(state["nodes_at"].tolist(), state["nodes"])]
        self.previous = state["previous"].clone() if self.leaves else None


class BandedNoise:
    """w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0 (32.5): row t of C^{-1} Z, keeping b - 1 vectors."""

    def __init__(self, draw: Draw, coefficients: Tensor) -> None:
        self.draw, self.c = draw, coefficients.double()
        self.rounds = 0
        self.history: list[Tensor] = []  # w_{t-1}, w_{t-2}, ..., at most b - 1 of them

    def next(self) -> Tensor:
        w = self.draw(0, self.rounds)
        for j, previous in enumerate(self.history, start=1):
            w = w - self.c[j] * previous
        w = w / self.c[0]
        self.history = [w, *self.history][: len(self.c) - 1]
        self.rounds += 1
        return w

    def state_dict(self) -> dict[str, Tensor]:
        history = torch.stack(self.history) if self.history else torch.zeros(0)
        return {"rounds": torch.tensor(self.rounds), "history": history, "coefficients": self.c.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.rounds = int(state["rounds"])
        self.history = [w.clone() for w in state["history"]] if self.rounds else []


def prefix_error(c: np.ndarray, rounds: int) -> tuple[float, np.ndarray]:
    """||A C^{-1}||_F^2 ||c||^2 of (32.6) and its gradient in c: the total squared error of the T prefix sums per unit
    sensitivity for the banded Toeplitz C of coefficients ``c`` (A: the prefix-sum matrix). O(T b) time and memory:
    d = C^{-1} e_0 (C's inverse is Toeplitz with coefficients d), e = cumsum(d), S = sum_k (T - k) e_k^2; with
    lambda = C^{-T} A^T W A d (W = diag(T - k)), dS/dc_j = -2 sum_k lambda_k d_{k-j}."""
    from scipy.linalg import solve_banded

    c, bands = np.asarray(c, dtype=np.float64), len(c)
    lower = np.zeros((bands, rounds))  # C in solve_banded's layout: row i holds the i-th subdiagonal
    for j in range(bands):
        lower[j, : rounds - j] = c[j]
    unit = np.zeros(rounds)
    unit[0] = 1.0
    d = solve_banded((bands - 1, 0), lower, unit)
    weights = np.arange(rounds, 0, -1, dtype=np.float64)
    e = np.cumsum(d)
    S = float(weights @ e**2)
    g = np.cumsum((weights * e)[::-1])[::-1]  # A^T W A d
    upper = np.zeros((bands, rounds))  # C^T: row b-1-i holds the i-th superdiagonal
    for j in range(bands):
        upper[bands - 1 - j, j:] = c[j]
    lam = solve_banded((0, bands - 1), upper, g)
    dS = np.array([-2.0 * float(lam[j:] @ d[: rounds - j]) for j in range(bands)])
    norm = float(c @ c)
    return S * norm, dS * norm + 2.0 * S * c


def banded_toeplitz(bands: int, rounds: int) -> Tensor:
    """The b coefficients of the banded Toeplitz C minimising (32.6), scaled to unit column norm: c_0 = 1 and
    c_1..c_{b-1} by L-BFGS-B (scipy) in float64 with the gradient of ``prefix_error``, from the truncated square
    root of the prefix-sum matrix (c_j = binom(2j, j) / 4^j, Fichtenberger et al. 2023), then c / ||c||."""
    from scipy.optimize import minimize

    bands = min(bands, rounds)
    if bands == 1:
        return torch.ones(1, dtype=torch.float64)
    start = np.array([math.comb(2 * j, j) / 4.0**j for j in range(1, bands)])

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = prefix_error(np.concatenate([[1.0], theta]), rounds)
        return value, grad[1:]

    theta = minimize(loss, start, jac=True, method="L-BFGS-B", options={"maxiter": 500, "ftol": 1e-15, "gtol": 1e-12}).x
    c = np.concatenate([[1.0], theta])
    return torch.from_numpy(c / np.linalg.norm(c))


def tree_rows(rounds: int, period: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The nodes completed within ``rounds`` of a tree restarted every ``period`` rounds (None: one tree):
    (first leaf, width, round of release) of each, the release the round of its last leaf."""
    first, width = [], []
    period = period or max(rounds, 1)
    for start in range(0, rounds, period):
        leaves = min(period, rounds - start)
        for height in range(leaves.bit_length()):
            span = 1 << height
            starts = start + np.arange(0, leaves - span + 1, span)
            first.append(starts)
            width.append(np.full(len(starts), span))
    first, width = np.concatenate(first), np.concatenate(width)
    return first, width, first + width - 1


def sensitivities(mechanism: str, participations: list[np.ndarray], rounds: int, coefficients: np.ndarray | None = None,
                  period: int | None = None) -> np.ndarray:  # fmt: skip
    """Delta_t of (32.7) for t = 1..T: the L2 sensitivity (per unit clip norm) of the first t rounds' release
    C X + Z, the maximum over the schedule's participation patterns (each an array of rounds) of
    ||(|C| 1_pattern) restricted to the rows released by round t||; exact where C >= 0 (the tree; a banded
    C whose bands do not exceed the separation has no cross terms). The trees of a restarted tree (``period``)
    are its rows' blocks: their Gaussian releases compose into one of the summed squared sensitivities."""
    worst = np.zeros(rounds)
    for pattern in participations:
        x = np.zeros(rounds)
        x[pattern] = 1.0
        if mechanism == "banded":
            row = np.convolve(x, np.abs(coefficients))[:rounds]  # (|C| x)_r, released at round r
            squared = np.cumsum(row**2)
        else:
            first, width, release = tree_rows(rounds, period)
            counts = np.concatenate([[0.0], np.cumsum(x)])
            per_round = np.zeros(rounds)
            np.add.at(per_round, release, (counts[first + width] - counts[first]) ** 2)
            squared = np.cumsum(per_round)
        worst = np.maximum(worst, squared)
    return np.sqrt(worst)

"""Privacy accounting of distributed DP's summed noise (docs/privacy.md, "Secure aggregation and distributed DP";
docs/algorithms.md, (31.11), (31.12)): one RDP curve per round, rounds composed by adding the curves, (epsilon, delta)
by the client-level accountant's conversion (Balle et al. 2020, dp-accounting's ``compute_epsilon``). The orders:
the discrete Gaussian's zCDP holds at every order, so it takes dp-accounting's default orders (fractional ones from
1.1, as the client-level accountant's Poisson sampling); Skellam's bound is used at the integer orders of
``fl_lightning.pipeline.privacy_accounting.ORDERS``. Each round is accounted with the clients
whose noise reached the sum: a client that dropped took its share of the noise with it.

Add/remove-one-client adjacency on the rounded, rotated integer vector: L2 sensitivity Delta_2 (the conditional
rounding's bound) and L1 sensitivity Delta_1 = min(sqrt(d) Delta_2, Delta_2^2) (an integer vector's L1 norm is at
most its squared L2 norm). No amplification by sampling is claimed.
"""

from __future__ import annotations

import math

import numpy as np

from fl_lightning.pipeline.privacy_accounting import ORDERS, orders


def orders_of(noise: str) -> tuple[float, ...]:
    """The RDP orders a noise is accounted at (module docstring)."""
    return orders("poisson") if noise == "gaussian" else tuple(float(a) for a in ORDERS)


def l1_sensitivity(l2: float, size: int) -> float:
    return min(math.sqrt(size) * l2, l2**2)


def ddg_epsilon(l2: float, l1: float, sigma: float, clients: int, size: int) -> float:
    """The epsilon of the (epsilon^2 / 2)-zCDP that the sum of ``clients`` discrete Gaussians N_Z(0, sigma^2) per
    coordinate gives a sum of integer vectors of sensitivities (l2, l1) in dimension d (Kairouz, Liu, Steinke 2021,
    Thm. 1; (31.11)): min(sqrt(l2^2 / (n sigma^2) + tau d / 2), l1 / (sqrt(n) sigma) + tau d),
    tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))."""
    if clients == 0 or sigma == 0:
        return math.inf
    tau = 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, clients))
    return min(math.sqrt(l2**2 / (clients * sigma**2) + tau * size / 2), l1 / (math.sqrt(clients) * sigma) + tau * size)


def ddg_rdp(l2: float, l1: float, sigma: float, clients: int, size: int) -> np.ndarray:
    """The RDP curve of (31.11) at ``orders_of("gaussian")``: rho-zCDP is (alpha, alpha rho)-RDP, rho = epsilon^2 / 2."""
    epsilon = ddg_epsilon(l2, l1, sigma, clients, size)
    return np.asarray(orders_of("gaussian"), dtype=np.float64) * epsilon**2 / 2


def skellam_rdp(l2: float, l1: float, variance: float) -> np.ndarray:
    """The RDP curve at ``ORDERS`` of adding Sk(0, mu) per coordinate (mu: the summed noise's variance) to a sum of
    sensitivities (l2, l1) (Agarwal, Kairouz, Liu 2021, Thm. 3.5; (31.12)):
    alpha l2^2 / (2 mu) + min(((2 alpha - 1) l2^2 + 6 l1) / (4 mu^2), 3 l1 / (2 mu))."""
    alpha = np.asarray(ORDERS, dtype=np.float64)
    if variance == 0:
        return np.full(len(ORDERS), np.inf)
    return alpha * l2**2 / (2 * variance) + np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance))


def epsilon_of(rdp: np.ndarray, delta: float, at: tuple[float, ...]) -> float:
    """(epsilon, delta) of an RDP curve at the orders ``at`` (the client-level accountant's conversion)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not np.any(np.isfinite(rdp)):
        return math.inf
    return float(compute_epsilon(at, rdp, delta)[0])


class DistributedAccountant:
    """The RDP spent so far (the sum of the rounds' curves, at ``orders_of(noise)``) and the rounds accounted."""

    def __init__(self, delta: float, noise: str) -> None:
        self.delta, self.rounds, self.orders = delta, 0, orders_of(noise)
        self.rdp = np.zeros(len(self.orders))

    def step(self, curve: np.ndarray) -> None:
        self.rdp, self.rounds = self.rdp + curve, self.rounds + 1

    def epsilon(self) -> float:
        return epsilon_of(self.rdp, self.delta, self.orders) if self.rounds else 0.0

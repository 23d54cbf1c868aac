"""Privacy accounting of client-level DP with ``dp-accounting`` (docs/privacy.md, "Accounting").

The events follow what the run does each round:

* ``BernoulliParticipation`` (client n active with probability p_n^k, independently): for each
  client, ``PoissonSampledDpEvent(p_n^k, GaussianDpEvent(sigma))`` under add-or-remove-one
  (the clipped sum's sensitivity is C). Every client has its own epsilon; the logged
  ``privacy/epsilon`` is the worst client's, ``privacy/epsilon_median`` and ``_min`` the rest.
* ``UniformSampling`` (S of N without replacement): ``SampledWithoutReplacementDpEvent(N, S,
  GaussianDpEvent(sigma / 2))`` under replace-one (replacing a client's data moves the clipped
  sum by up to 2C, so the noise is sigma/2 times that sensitivity).

Rounds compose (RDP adds up). ``rdp`` (the default) evaluates Poisson sampling at dp-accounting's
default orders (fractional ones by numerical integration) and sampling without replacement at integer orders (see
``orders``); ``pld`` (privacy loss distributions, tighter) supports probabilities that are fixed over
rounds and self-composes one cached round's distribution T times (``pld_poisson_epsilon``).
The accountant's state is the number of rounds accounted: the events are a deterministic
function of the participation and the round, so a resumed run replays them to the same value.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from typing import Any, Literal

import numpy as np

ORDERS = (*range(2, 65), 80, 96, 128, 192, 256)
"""RDP orders of sampling without replacement: integers, dense where epsilons of 0.1-100 take their
minimum, sparse above (the bound costs O(order^2) per order). dp-accounting states that bound
(Wang, Balle, Kasiviswanathan 2019, Thm 27) at integer orders only; at a fractional order it
interpolates the cumulant generating function linearly between the two integer neighbours (their
Cor. 10), a valid bound whose main epsilon term (the CGF plus log(1/delta), over alpha - 1) is then
monotone between the neighbours, so fractional orders gain nothing there (tests/test_privacy_accounting.py:
equal epsilons)."""


def orders(kind: str) -> tuple[float, ...]:
    """The RDP orders of a sampling ``kind`` (docs/privacy.md, "RDP orders"): Poisson sampling uses
    dp-accounting's default orders (1.1 to 10.9 by 0.1, 11 to 63, 128, 256, 512, 1024), the fractional ones
    integrated exactly (``poisson_gaussian_log_moment``: dp-accounting's series over-states them by 8-35 % at low
    sigma, or diverges). Sampling without replacement uses the integer ``ORDERS``."""
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return tuple(float(a) for a in DEFAULT_RDP_ORDERS) if kind == "poisson" else ORDERS


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting logs a warning for each fractional order whose series does not converge (small
    orders at large q, where the order is useless anyway); that order's RDP is infinite, i.e. excluded
    from the minimum over orders, which stays valid. The warning is not the user's concern."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class SamplingScheme:
    """How clients are sampled per round, as the accountant sees it."""

    def __init__(
        self,
        kind: Literal["poisson", "without_replacement"],
        num_clients: int,
        probabilities=None,
        sample_size: int = 0,
        fixed: bool = True,
    ):
        self.kind, self.num_clients, self._probabilities, self.sample_size = kind, num_clients, probabilities, sample_size
        self.fixed = fixed  # the per-client probabilities are the same every round

    @classmethod
    def of(cls, participation: Any, num_clients: int) -> SamplingScheme:
        """The scheme of a ``Participation`` (others are refused: their events are not stated)."""
        from fl_lightning.core.participation import BernoulliParticipation, FixedProbabilities, UniformRandomProbabilities, UniformSampling

        if isinstance(participation, BernoulliParticipation):
            fixed = isinstance(participation.probabilities, (FixedProbabilities, UniformRandomProbabilities))
            return cls("poisson", num_clients, lambda k: participation.probabilities_at(k, num_clients).numpy(), fixed=fixed)
        if isinstance(participation, UniformSampling):
            return cls("without_replacement", num_clients, sample_size=participation.count(num_clients))
        raise ValueError(
            f"privacy: participation {type(participation).__name__} has no stated privacy accounting; "
            "use UniformSampling or BernoulliParticipation"
        )

    def probabilities(self, round_idx: int) -> np.ndarray:
        """Each client's probability of taking part in round ``round_idx``."""
        if self.kind == "poisson":
            return np.asarray(self._probabilities(round_idx), dtype=np.float64)
        return np.full(self.num_clients, self.sample_size / self.num_clients)

    def expected_cohort(self, round_idx: int) -> float:
        """The fixed denominator: the expected number of clients in the round."""
        if self.kind == "poisson":
            return float(self.probabilities(round_idx).sum())
        return float(self.sample_size)



def _rdp_round(scheme: SamplingScheme, p: float, sigma: float | tuple[float, ...]) -> np.ndarray:
    return _rdp_event(scheme.kind, scheme.num_clients, scheme.sample_size, p, sigma)


def _queries(kind: str, sigma: float | tuple[float, ...]):
    """The round's Gaussian queries as a ``DpEvent``: sigma, or (update sigma, count sigma) for adaptive
    clipping (Andrew et al. 2021: the clipped count b_i - 1/2 has sensitivity 1/2 under add/remove, 1 under
    replace; the clipped sum C, resp. 2C)."""
    import dp_accounting

    if not isinstance(sigma, tuple):
        return dp_accounting.GaussianDpEvent(sigma if kind == "poisson" else sigma / 2)
    update, count = sigma
    if kind == "poisson":
        return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(update), dp_accounting.GaussianDpEvent(2 * count)])
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(update / 2), dp_accounting.GaussianDpEvent(count)])


def poisson_gaussian_log_moment(q: float, sigma: float, alpha: float, points: int = 40001) -> float:
    """log A_alpha of the Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019, Sec. 3.3, (3)):
    A_alpha = E_{z ~ N(0, sigma^2)} [((1 - q) + q exp((2z - 1) / (2 sigma^2)))^alpha], by the trapezoid rule in log
    space on a grid that covers the integrand's mass (its peak lies between 0 and about alpha); exact to the
    grid's resolution at any order alpha > 1, where dp-accounting's series for a fractional order is an upper
    bound or, at small orders, diverges (docs/privacy.md, "RDP orders")."""
    lo, hi = -12.0 * sigma - 1.0, alpha + 12.0 * sigma * math.sqrt(alpha) + 1.0
    z = np.linspace(lo, hi, points)
    log_mix = np.logaddexp(math.log1p(-q), math.log(q) + (2.0 * z - 1.0) / (2.0 * sigma**2)) if q < 1 else (2.0 * z - 1.0) / (2.0 * sigma**2)
    log_f = -(z**2) / (2.0 * sigma**2) - math.log(sigma * math.sqrt(2.0 * math.pi)) + alpha * log_mix
    peak = float(log_f.max())
    weights = np.full(points, z[1] - z[0])
    weights[[0, -1]] /= 2.0
    return peak + math.log(float((np.exp(log_f - peak) * weights).sum()))


def _effective_sigma(sigma: float | tuple[float, ...]) -> float:
    """The Poisson round's queries as one Gaussian: (update sigma, count sigma) under add/remove compose to
    1 / sigma^2 = 1 / sigma_u^2 + 1 / (2 sigma_c)^2 (a Gaussian query on the concatenated, sensitivity-1 vector)."""
    if not isinstance(sigma, tuple):
        return float(sigma)
    update, count = sigma
    return (1.0 / update**2 + 1.0 / (2.0 * count) ** 2) ** -0.5


@functools.lru_cache(maxsize=4096)
def _rdp_event(kind: str, num_clients: int, sample_size: int, p: float, sigma: float | tuple[float, ...]) -> np.ndarray:
    """One round's RDP curve at ``orders(kind)`` (cached: calibration and replays ask for the same events)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import NeighborRel

    if sigma == 0 or (isinstance(sigma, tuple) and 0 in sigma):
        return np.full(len(orders(kind)), np.inf)
    if kind == "poisson":
        accountant = RdpAccountant(list(orders(kind)))
        with _quiet_absl():
            accountant.compose(dp_accounting.PoissonSampledDpEvent(p, _queries(kind, sigma)))
        rdp = np.asarray(accountant._rdp, dtype=np.float64).copy()
        if 0 < p < 1:  # fractional orders exactly (dp-accounting's series bounds them loosely or not at all)
            for i, alpha in enumerate(orders(kind)):
                if alpha != int(alpha):
                    rdp[i] = poisson_gaussian_log_moment(p, _effective_sigma(sigma), alpha) / (alpha - 1.0)
        rdp.flags.writeable = False
        return rdp
    else:
        accountant = RdpAccountant(list(orders(kind)), NeighborRel.REPLACE_ONE)
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(num_clients, sample_size, _queries(kind, sigma)))
    rdp = np.asarray(accountant._rdp, dtype=np.float64)  # the RDP curve of one round at orders(kind)
    rdp.flags.writeable = False
    return rdp


def _epsilon_from_rdp(rdp: np.ndarray, delta: float, kind: str) -> float:
    """Balle et al. 2020's conversion at the best order; orders whose RDP is infinite (a fractional
    series that did not converge) are left out, as dp-accounting does; all infinite: no guarantee."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not np.any(np.isfinite(rdp)):
        return math.inf
    return float(compute_epsilon(orders(kind), rdp, delta)[0])


@functools.lru_cache(maxsize=64)
def _pld_event(p: float, sigma: float | tuple[float, ...]) -> Any:
    """One Poisson-sampled round's (or local step's) privacy loss distribution, built by dp-accounting's
    ``PLDAccountant`` from ``PoissonSampledDpEvent(p, query)`` (cached: building it is most of the cost;
    PLDs are immutable, composing returns a new one)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(p, _queries("poisson", sigma)))
    return accountant._pld  # the distribution of one event


@functools.lru_cache(maxsize=4096)
def pld_poisson_epsilon(p: float, sigma: float | tuple[float, ...], steps: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``steps`` compositions of the Gaussian query ``sigma`` (see ``_queries``),
    each Poisson-sampled with probability ``p``, add/remove adjacency, by privacy loss distributions (the
    client-level rounds and the record-level local steps alike).

    The cached one-event distribution is self-composed ``steps`` times (one FFT power, whatever the
    history), so a round costs one self-composition instead of rebuilding the event, and the value is a
    function of (p, sigma, steps) alone: a resumed run gets the same floats. It differs from
    dp-accounting's ``PLDAccountant`` composing ``SelfComposedDpEvent(event, steps)`` from scratch (which
    composes that same power with the identity distribution) by float rounding only: < 1e-9 relative
    (measured 4e-13 to 4e-12 up to 1000 steps; tests/test_privacy_accounting.py)."""
    if steps == 0:
        return 0.0
    if sigma == 0 or (isinstance(sigma, tuple) and 0 in sigma):
        return math.inf
    return float(_pld_event(p, sigma).self_compose(steps).get_epsilon_for_delta(delta))


class ClientAccountant:
    """The epsilon of every client after the rounds run so far (``step`` once a round).

    Args:
        scheme: the sampling scheme.
        noise_multiplier: sigma (noise std / C), or (update sigma, count sigma) under adaptive clipping.
        delta: the delta at which epsilon is reported.
        method: ``"rdp"`` or ``"pld"``.
    """

    def __init__(self, scheme: SamplingScheme, noise_multiplier: float, delta: float, method: str = "rdp") -> None:
        if method not in ("rdp", "pld"):
            raise ValueError(f"privacy.accountant must be 'rdp' or 'pld', got {method!r}")
        if method == "pld" and not scheme.fixed:
            raise ValueError("privacy.accountant='pld' needs activation probabilities fixed over rounds; use 'rdp'")
        self.scheme, self.sigma, self.delta, self.method = scheme, noise_multiplier, delta, method
        self.rounds = 0
        self._cache: dict[float, np.ndarray] = {}
        self._rdp: np.ndarray | None = None  # [clients, orders]: the RDP each client has spent (rdp)

    def _round_rdp(self, p: float) -> np.ndarray:
        if p not in self._cache:
            self._cache[p] = _rdp_round(self.scheme, p, self.sigma)
        return self._cache[p]

    def step(self) -> None:
        """Account one more round (its index: ``self.rounds``)."""
        if self.method == "rdp":
            p = self.scheme.probabilities(self.rounds)
            values, inverse = np.unique(p, return_inverse=True)
            table = np.stack([self._round_rdp(float(v)) for v in values])[inverse]
            if self.scheme.fixed:  # rounds x one round's RDP: the same floats however the rounds were reached
                self._rdp = table * (self.rounds + 1)
            else:
                self._rdp = table if self._rdp is None else self._rdp + table
        self.rounds += 1

    def replay(self, rounds: int) -> None:
        """Restore the state after ``rounds`` rounds (resume): the events are a function of the round."""
        self.rounds, self._rdp = 0, None
        if self.scheme.fixed and rounds:
            self.rounds = rounds - 1
            self.step()
            return
        for _ in range(rounds):
            self.step()

    def epsilon_after_next(self) -> float:
        """The worst client's epsilon once one more round is accounted (this accountant unchanged): the
        value ``step`` then reports, without replaying the history (``budget: stop``)."""
        ahead = copy.copy(self)  # step rebinds _rdp (never writes into it), so the copy shares nothing it changes
        ahead.step()
        return ahead.epsilon()

    def epsilons(self) -> np.ndarray:
        """Each client's epsilon at ``delta`` (clients with equal histories computed once)."""
        if self.rounds == 0:
            return np.zeros(self.scheme.num_clients)
        if self.method == "pld":
            p = self.scheme.probabilities(0)
            values, inverse = np.unique(p, return_inverse=True)
            return np.array([self._pld_epsilon(float(v), self.rounds) for v in values])[inverse]
        rows, inverse = np.unique(self._rdp, axis=0, return_inverse=True)
        return np.array([_epsilon_from_rdp(r, self.delta, self.scheme.kind) for r in rows])[np.asarray(inverse).reshape(-1)]

    def epsilon(self) -> float:
        """The worst client's epsilon."""
        return float(self.epsilons().max()) if self.rounds else 0.0

    def _pld_epsilon(self, p: float, rounds: int) -> float:
        if self.sigma == 0 or (isinstance(self.sigma, tuple) and 0 in self.sigma):
            return math.inf
        if self.scheme.kind != "poisson":  # refused before training where it is configured (ClientPrivacy.prepare)
            raise ValueError("accountant 'pld' accounts Poisson sampling only: dp-accounting's PLD has no rule for sampling without replacement")
        return pld_poisson_epsilon(p, self.sigma, rounds, self.delta)


def epsilon_after(scheme: SamplingScheme, noise_multiplier: float, delta: float, rounds: int, method: str = "rdp") -> float:
    """The worst client's epsilon after ``rounds`` rounds at ``noise_multiplier``."""
    accountant = ClientAccountant(scheme, noise_multiplier, delta, method)
    accountant.replay(rounds)
    return accountant.epsilon()


def calibrate_noise(scheme: SamplingScheme, target_epsilon: float, delta: float, rounds: int, method: str = "rdp") -> float:
    """The smallest noise multiplier (to 0.1 %) whose epsilon after ``rounds`` rounds is at most
    ``target_epsilon``: a binary search through the accountant."""
    low, high = 0.05, 100.0
    if epsilon_after(scheme, high, delta, rounds, method) > target_epsilon:
        raise ValueError(
            f"privacy.target_epsilon={target_epsilon} cannot be reached in {rounds} rounds at delta={delta} "
            f"(noise_multiplier {high} still gives more); raise target_epsilon or lower trainer.max_steps"
        )
    if epsilon_after(scheme, low, delta, rounds, method) <= target_epsilon:
        return low
    while high - low > 1e-3 * high:
        mid = math.sqrt(low * high)
        if epsilon_after(scheme, mid, delta, rounds, method) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high

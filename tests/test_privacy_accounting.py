"""The accountant against independent references, one test per sampling scheme (docs/privacy.md).

* Poisson (``BernoulliParticipation``), RDP: our own numpy RDP of the Poisson-subsampled Gaussian
  at integer orders (Mironov, Talwar, Zhang 2019, Sec. 3.3: A_a = sum_k C(a,k) (1-q)^(a-k) q^k
  exp((k^2-k)/(2 sigma^2))), converted to (epsilon, delta) by Balle et al. 2020, Thm 21.
* Poisson, PLD: ``prv-accountant`` (Gopi, Lee, Wutschitz 2021), a different numerical method.
* Without replacement (``UniformSampling``): our own numpy of Wang, Balle, Kasiviswanathan 2019,
  Thm 9 for the Gaussian (eps(j) = j / (2 sigma^2), eps(inf) = inf), replace-one, sigma / 2.
Each within 1 %.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import gammaln, logsumexp

from fl_lightning.core.participation import BernoulliParticipation, PeriodicProbabilities, UniformSampling
from fl_lightning.pipeline.privacy_accounting import ORDERS as _ORDERS
from fl_lightning.pipeline.privacy_accounting import ClientAccountant, SamplingScheme, calibrate_noise, epsilon_after

ORDERS = np.array(_ORDERS)  # the same orders (a choice of evaluation points, not of method)


def _log_comb(n, k):
    return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)


def _rdp_poisson(q, sigma, a):
    k = np.arange(a + 1)
    return logsumexp(_log_comb(a, k) + (a - k) * np.log1p(-q) + k * np.log(q) + (k * k - k) / (2 * sigma**2)) / (a - 1)


def _rdp_without_replacement(q, sigma, a):
    e2 = 1 / sigma**2  # eps(2) = 2 / (2 sigma^2)
    terms = [0.0, 2 * np.log(q) + _log_comb(a, 2) + min(np.log(4) + np.log(np.expm1(e2)), e2 + np.log(2))]
    terms += [np.log(2) + j * np.log(q) + _log_comb(a, j) + (j - 1) * j / (2 * sigma**2) for j in range(3, a + 1)]
    return logsumexp(terms) / (a - 1)


def _epsilon(rdp, delta):
    a = ORDERS.astype(float)
    return float(np.min(rdp - (np.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)))


POISSON_CASES = [(0.1, 1.0, 100, 1e-5), (0.01, 1.2, 500, 1e-6), (0.25, 2.0, 60, 1e-4)]


@pytest.mark.parametrize("q, sigma, rounds, delta", POISSON_CASES)
def test_poisson_rdp_epsilon_matches_an_independent_rdp_computation(q, sigma, rounds, delta):
    scheme = SamplingScheme.of(BernoulliParticipation(q), 50)
    reference = _epsilon(np.array([_rdp_poisson(q, sigma, a) for a in ORDERS]) * rounds, delta)
    assert epsilon_after(scheme, sigma, delta, rounds, "rdp") == pytest.approx(reference, rel=0.01)


def test_poisson_pld_epsilon_matches_prv_accountant():
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    q, sigma, rounds, delta = 0.1, 1.0, 100, 1e-5
    mechanism = PoissonSubsampledGaussianMechanism(noise_multiplier=sigma, sampling_probability=q)
    prv = PRVAccountant(mechanism, eps_error=0.01, delta_error=1e-9, max_self_compositions=rounds)
    reference = prv.compute_epsilon(delta=delta, num_self_compositions=rounds)[1]
    ours = epsilon_after(SamplingScheme.of(BernoulliParticipation(q), 20), sigma, delta, rounds, "pld")
    assert ours == pytest.approx(reference, rel=0.01)


@pytest.mark.parametrize("n, s, sigma, rounds, delta", [(1000, 100, 1.0, 100, 1e-5), (200, 10, 3.0, 200, 1e-5)])
def test_without_replacement_epsilon_matches_an_independent_computation(n, s, sigma, rounds, delta):
    scheme = SamplingScheme.of(UniformSampling(s), n)
    reference = _epsilon(np.array([_rdp_without_replacement(s / n, sigma / 2, a) for a in ORDERS]) * rounds, delta)
    assert epsilon_after(scheme, sigma, delta, rounds, "rdp") == pytest.approx(reference, rel=0.01)


def test_heterogeneous_probabilities_report_every_client_and_the_worst():
    p = [0.05, 0.1, 0.1, 0.3]
    accountant = ClientAccountant(SamplingScheme.of(BernoulliParticipation(p), 4), 1.0, 1e-5)
    accountant.replay(50)
    eps = accountant.epsilons()
    for value, q in zip(eps, p):
        assert value == pytest.approx(_epsilon(np.array([_rdp_poisson(q, 1.0, a) for a in ORDERS]) * 50, 1e-5), rel=0.01)
    assert accountant.epsilon() == eps[3] == max(eps) and eps[1] == eps[2]


def test_time_varying_probabilities_compose_round_by_round_and_replay_identically():
    participation = BernoulliParticipation(PeriodicProbabilities(0.1, 0.5, period=5.0, seed=3))
    scheme = SamplingScheme.of(participation, 3)
    assert not scheme.fixed
    stepped = ClientAccountant(scheme, 1.0, 1e-5)
    for _ in range(4):
        stepped.step()
    replayed = ClientAccountant(scheme, 1.0, 1e-5)
    replayed.replay(4)
    assert np.array_equal(stepped.epsilons(), replayed.epsilons())
    client = 2  # its own probabilities, round by round
    qs = [float(participation.probabilities_at(k, 3)[client]) for k in range(4)]
    rdp = sum(np.array([_rdp_poisson(q, 1.0, a) for a in ORDERS]) for q in qs)
    assert stepped.epsilons()[client] == pytest.approx(_epsilon(rdp, 1e-5), rel=0.01)


def test_calibration_finds_the_smallest_sigma_within_the_budget():
    scheme = SamplingScheme.of(BernoulliParticipation(0.1), 100)
    sigma = calibrate_noise(scheme, 3.0, 1e-5, 100)
    assert epsilon_after(scheme, sigma, 1e-5, 100) <= 3.0 < epsilon_after(scheme, sigma * 0.99, 1e-5, 100)


def test_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="target_epsilon=1e-06 cannot be reached in 1000 rounds"):
        calibrate_noise(SamplingScheme.of(UniformSampling(50), 100), 1e-6, 1e-5, 1000)


def test_fixed_probabilities_give_the_same_floats_stepped_or_replayed():
    scheme = SamplingScheme.of(UniformSampling(5), 40)
    a = ClientAccountant(scheme, 1.3, 1e-5)
    for _ in range(9):
        a.step()
    b = ClientAccountant(scheme, 1.3, 1e-5)
    b.replay(9)
    assert a.epsilon() == b.epsilon() and math.isfinite(a.epsilon())

"""Distributed DP under secure aggregation (fl_lightning/secagg, docs/algorithms.md (31.6)-(31.12)): the discrete
Gaussian and Skellam samplers against their exact pmfs (moments, chi-square), the rotation and conditional rounding,
the summed noise of the survivors only, and epsilon against the published bounds recomputed here in numpy."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from scipy import special, stats

from datamodules import IID
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.participation import UniformSampling
from fl_lightning.engine.module import FederatedModule
from fl_lightning.secagg import SecureAggregation
from fl_lightning.secagg.accounting import ddg_rdp, skellam_rdp
from fl_lightning.secagg.encoding import clip_rows, padded, rotate, unrotate
from fl_lightning.secagg.samplers import discrete_gaussian, skellam
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

DRAWS = 100_000


def _goodness_of_fit(draws: np.ndarray, support: np.ndarray, pmf: np.ndarray) -> float:
    """The chi-square test's p-value of the draws against the pmf, bins of expected count >= 5 (tails lumped)."""
    counts = np.array([(draws == y).sum() for y in support], dtype=np.float64)
    expected = pmf * len(draws)
    keep = expected >= 5
    observed = np.append(counts[keep], len(draws) - counts[keep].sum())
    expected = np.append(expected[keep], len(draws) - expected[keep].sum())
    return float(stats.chisquare(observed, expected).pvalue)


def _check_moments(draws: np.ndarray, support: np.ndarray, pmf: np.ndarray) -> None:
    variance = float((support**2 * pmf).sum())
    fourth = float((support**4 * pmf).sum())
    assert abs(draws.mean()) < 5 * math.sqrt(variance / len(draws))
    assert abs((draws.astype(np.float64) ** 2).mean() - variance) < 5 * math.sqrt((fourth - variance**2) / len(draws))


@pytest.mark.parametrize("sigma", [0.8, 3.0, 12.5])
def test_the_discrete_gaussian_matches_its_pmf(sigma):
    draws = discrete_gaussian(sigma, DRAWS, torch.Generator().manual_seed(1)).numpy()
    support = np.arange(-int(15 * sigma) - 2, int(15 * sigma) + 3)
    pmf = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma**2))
    pmf /= pmf.sum()
    _check_moments(draws, support, pmf)
    assert _goodness_of_fit(draws, support, pmf) > 1e-3


@pytest.mark.parametrize("mu", [0.5, 4.0, 60.0])
def test_skellam_matches_its_pmf(mu):
    """Sk(0, mu) = Poisson(mu/2) - Poisson(mu/2): P(k) = e^{-mu} I_|k|(mu), variance mu."""
    draws = skellam(mu, DRAWS, torch.Generator().manual_seed(2)).numpy()
    support = np.arange(-int(10 * math.sqrt(mu)) - 10, int(10 * math.sqrt(mu)) + 11)
    pmf = special.ive(np.abs(support), mu)  # I_k(mu) e^{-mu}
    _check_moments(draws, support, pmf / pmf.sum())
    assert abs(float((support**2 * pmf).sum()) - mu) < 1e-9  # the pmf itself has variance mu
    assert _goodness_of_fit(draws, support, pmf / pmf.sum()) > 1e-3


def test_the_samplers_are_fixed_by_their_seed():
    for draw, scale in ((discrete_gaussian, 2.0), (skellam, 4.0)):
        a, b = (draw(scale, 100, torch.Generator().manual_seed(9)) for _ in range(2))
        assert torch.equal(a, b) and not torch.equal(a, draw(scale, 100, torch.Generator().manual_seed(10)))


def test_the_rotation_is_orthogonal_and_inverted():
    x = torch.randn(3, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    signs = 1.0 - 2.0 * torch.randint(0, 2, (padded(37),), generator=torch.Generator().manual_seed(1)).double()
    y = rotate(x, signs)
    hadamard = torch.from_numpy(__import__("scipy.linalg", fromlist=["hadamard"]).hadamard(64).astype(np.float64)) / 8.0
    reference = (torch.nn.functional.pad(x, (0, 27)) * signs) @ hadamard.T  # H D x / sqrt(d), scipy's Sylvester matrix
    torch.testing.assert_close(y, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(unrotate(y, signs, 37), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("noise", ["gaussian", "skellam"])
def test_only_the_survivors_noise_reaches_the_sum(noise):
    """Zero vectors: the decoded sum is the noise of the arrived clients, of variance (z C)^2 n_arrived / n."""
    n, size, z = 10, 4096, 1.5
    secagg = SecureAggregation(bits=24, clip=1.0, noise=noise, noise_multiplier=z, dropout_after_masking=0.3)
    out = secagg.run(torch.zeros(n, size, dtype=torch.float64), list(range(n)), [50 + i for i in range(n)], 3)
    arrived = len(out.arrived)
    assert 0 < arrived < n
    expected = z**2 * arrived / n + arrived * out.metrics["secagg/gamma"] ** 2 / 4  # plus at most the rounding's
    assert abs(float(out.total.var()) / expected - 1) < 0.06


def test_without_noise_the_ddp_pipeline_decodes_within_the_rounding_bound():
    n, size = 6, 100
    vectors = torch.randn(n, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    secagg = SecureAggregation(bits=20, clip=3.0, noise="gaussian", noise_multiplier=0.0)
    out = secagg.run(vectors, list(range(n)), list(range(n)), 1)
    error = float(torch.linalg.vector_norm(out.total - clip_rows(vectors, 3.0).sum(0)))
    assert 0 < error <= out.metrics["secagg/gamma"] * n * math.sqrt(padded(size))


# ---- epsilon against the published bounds, recomputed here ----------------------------------------------
ORDERS = np.array([*range(2, 65), 80, 96, 128, 192, 256], dtype=np.float64)


def reference_epsilon(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) from RDP (Balle et al. 2020, Prop. 12; Canonne, Kamath, Steinke 2020):
    min_alpha rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)."""
    eps = rdp + np.log((ORDERS - 1) / ORDERS) - (np.log(delta) + np.log(ORDERS)) / (ORDERS - 1)
    return max(0.0, float(np.min(eps)))


def reference_ddg(l2, sigma, n, d):
    """Kairouz, Liu, Steinke (2021), Prop. 14: the RDP of the sum of n draws of N_Z(0, sigma^2) per coordinate, the
    least of its three bounds at each order."""
    l1 = min(math.sqrt(d) * l2, l2**2)
    tau = 10 * np.sum(np.exp(-2 * np.pi**2 * sigma**2 * np.arange(1, n) / np.arange(2, n + 1)))
    a, b = l2 / (np.sqrt(n) * sigma), l1 / (np.sqrt(n) * sigma)
    bounds = [ORDERS / 2 * a**2 + tau * d, ORDERS / 2 * (a**2 + 2 * b * tau + tau**2 * d), ORDERS / 2 * (a + np.sqrt(d) * tau) ** 2]
    return np.min(bounds, axis=0)


def reference_skellam(l2, mu, d):
    """Agarwal, Kairouz, Liu (2021), Thm. 3.5: the RDP of Sk(0, mu) per coordinate."""
    l1 = min(math.sqrt(d) * l2, l2**2)
    return ORDERS * l2**2 / (2 * mu) + np.minimum(((2 * ORDERS - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


@pytest.mark.parametrize("l2, sigma, n, d", [(30.0, 5.0, 10, 1024), (300.0, 0.6, 50, 8192), (3.0, 40.0, 2, 64)])
def test_the_ddg_rdp_is_the_published_bound(l2, sigma, n, d):
    l1 = min(math.sqrt(d) * l2, l2**2)
    expected = reference_ddg(l2, sigma, n, d)
    np.testing.assert_allclose(ddg_rdp(l2, l1, sigma, n, d), expected, rtol=1e-12)
    if sigma < 1:  # the tau terms matter: more than the discrete Gaussian's own alpha a^2 / 2
        assert np.all(expected > ORDERS / 2 * l2**2 / (n * sigma**2) * (1 + 1e-6))


@pytest.mark.parametrize("l2, mu, d", [(30.0, 400.0, 1024), (5.0, 2.0, 64)])
def test_the_skellam_rdp_is_the_published_bound(l2, mu, d):
    l1 = min(math.sqrt(d) * l2, l2**2)
    np.testing.assert_allclose(skellam_rdp(l2, l1, mu), reference_skellam(l2, mu, d), rtol=1e-12)


def _fit_logged(tmp_path, secagg, execution="sequential", rounds=3):
    torch.manual_seed(0)
    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[4]).double(), local=LocalTraining(lr=0.3, steps=2, batch_size=None),
                             execution=execution, secure_aggregation=secagg)  # fmt: skip
    data = tiny_datamodule(num_clients=6, partition=IID(), dtype="float64")
    data.participation = UniformSampling(6)
    tiny_trainer(tmp_path, rounds, precision="64-true", logger=CSVLogger(tmp_path, name="m")).fit(module, datamodule=data)
    (path,) = tmp_path.rglob("metrics.csv")
    with open(path) as f:
        return module, [r for r in csv.DictReader(f) if r.get("privacy/epsilon")]


@pytest.mark.parametrize("noise", ["gaussian", "skellam"])
def test_the_logged_epsilon_is_the_bound_of_the_noise_that_arrived(tmp_path, noise):
    """Each round recomputed from the logged granularity and arrivals: Delta_2 of conditional rounding, each client's
    std z C / (gamma sqrt(n)), the RDP of the arrived clients' summed noise, composed and converted in numpy."""
    clip, z, delta, beta, n = 1.0, 2.0, 1e-5, math.exp(-0.5), 6
    secagg = SecureAggregation(bits=16, clip=clip, noise=noise, noise_multiplier=z, delta=delta, dropout_after_masking=0.3)
    module, rows = _fit_logged(tmp_path, secagg, "batched")
    assert not module.executor.fallbacks
    d = padded(8 * 4 + 4 + 4 * 3 + 3)
    total, all_arrived = np.zeros(len(ORDERS)), np.zeros(len(ORDERS))
    for row in rows:
        gamma, arrived = float(row["secagg/gamma"]), int(float(row["secagg/clients"]))
        c = clip / gamma
        l2 = min(math.sqrt(c**2 + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2)), c + math.sqrt(d))
        sigma = z * clip / (gamma * math.sqrt(n))
        if noise == "gaussian":
            total += reference_ddg(l2, sigma, arrived, d)
            all_arrived += reference_ddg(l2, sigma, n, d)
        else:
            total += reference_skellam(l2, arrived * sigma**2, d)
            all_arrived += reference_skellam(l2, n * sigma**2, d)
        assert float(row["privacy/epsilon"]) == pytest.approx(reference_epsilon(total, delta), rel=1e-9)
    assert len(rows) == 3 and any(int(float(r["secagg/clients"])) < n for r in rows)
    assert reference_epsilon(total, delta) > reference_epsilon(all_arrived, delta)  # dropouts cost privacy


def _resumable(tmp_path, rounds, ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    secagg = SecureAggregation(bits=16, clip=1.0, neighbours=2, noise="skellam", noise_multiplier=1.0, dropout_after_masking=0.3)
    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[4]), local=LocalTraining(lr=0.3, steps=2, batch_size=8), secure_aggregation=secagg)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(6, 6), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_gives_the_same_model_and_epsilon_bitwise(tmp_path):
    straight, t1 = _resumable(tmp_path / "a", 3)
    _resumable(tmp_path / "b", 2)
    resumed, t2 = _resumable(tmp_path / "c", 3, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))
    stage = resumed.rounds.stage("secure_aggregation")
    assert stage.accountant.rounds == straight.rounds.stage("secure_aggregation").accountant.rounds > 0
    assert float(t1.callback_metrics["privacy/epsilon"]) == float(t2.callback_metrics["privacy/epsilon"]) > 0

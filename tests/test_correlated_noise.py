"""Client-level DP without sampling (``model.privacy: CorrelatedNoise``; docs/algorithms.md section 32): the
tree's and the banded factorization's noise against an independent numpy reference written from the papers
(the exact linear map of the Gaussian draws, and the covariance over many draws), the sensitivity under the
cyclic schedule and its epsilon, the banded optimiser's objective, the round stage (noise 0 is FedAvg under
the schedule bitwise, resume bitwise, the schedule refused in one line) and the configs through the CLI."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import IID, FederatedDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import FedAvgM
from fl_lightning.core.participation import CyclicParticipation
from fl_lightning.pipeline.correlated_noise import CorrelatedNoise
from fl_lightning.pipeline.matrix_factorization import BandedNoise, TreeNoise, banded_toeplitz, prefix_error
from models import MLP
from tests.conftest import assert_resumes_bitwise, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
RDP_ORDERS = [1.1 + 0.1 * i for i in range(99)] + list(range(11, 64)) + [128, 256, 512, 1024]


# ---- the numpy reference ------------------------------------------------------------------------------
def tree_nodes(rounds, period=None):
    """(height, first leaf) of every node completed within ``rounds`` leaves, a new tree every ``period``."""
    period = period or rounds
    return [(h, start + (i << h)) for start in range(0, rounds, period) for h in range(min(period, rounds - start).bit_length())
            for i in range(min(period, rounds - start) >> h)]  # fmt: skip


def dyadic(t, start=0):
    """The dyadic nodes (height, first leaf) whose leaves are exactly start .. start + t - 1."""
    nodes = []
    for h in reversed(range(t.bit_length())):
        if t & (1 << h):
            nodes.append((h, start))
            start += 1 << h
    return nodes


def subtree_estimate(z, height, first):
    """Honaker's estimate of a node's sum: least squares (pseudo-inverse) on every noisy node of its subtree."""
    leaves = 1 << height
    rows, values = [], []
    for h in range(height + 1):
        for i in range(leaves >> h):
            row = np.zeros(leaves)
            row[i << h : (i + 1) << h] = 1.0
            rows.append(row)
            values.append(z[(h, first + (i << h))])
    return np.ones(leaves) @ np.linalg.pinv(np.array(rows)) @ np.array(values)


def tree_reference(z, rounds, efficient, period=None):
    """w_t = (prefix noise of t + 1 leaves) - (of t leaves) within the round's tree, a prefix's noise its dyadic
    nodes' (Kairouz et al.); a new tree starts from no noise."""
    period = period or rounds

    def prefix(t, start):
        return sum((subtree_estimate(z, h, f) if efficient else z[(h, f)]) for h, f in dyadic(t, start)) if t else 0.0

    out = []
    for t in range(rounds):
        start = t - t % period
        out.append(prefix(t - start + 1, start) - prefix(t - start, start))
    return np.array(out)


def banded_matrix(c, rounds):
    C = np.zeros((rounds, rounds))
    for i in range(rounds):
        for j in range(max(0, i - len(c) + 1), i + 1):
            C[i, j] = c[i - j]
    return C


def draws(rounds, size, seed=0, period=None):
    rng = np.random.default_rng(seed)
    return {node: rng.standard_normal(size) for node in tree_nodes(rounds, period)}


def from_table(z):
    return lambda h, i: torch.from_numpy(z[(h, i)])


# ---- the noise ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("efficient, period", [(False, None), (True, None), (True, 5)])
def test_tree_noise_is_the_papers_linear_map_of_the_node_draws(efficient, period):
    rounds = 13
    z = draws(rounds, 5, period=period)
    noise = TreeNoise(from_table(z), efficient, period)
    got = np.stack([noise.next().numpy() for _ in range(rounds)])
    np.testing.assert_allclose(got, tree_reference(z, rounds, efficient, period), rtol=0, atol=1e-12)


def test_banded_noise_is_c_inverse_z_and_keeps_b_minus_one_vectors():
    rounds, c = 20, np.array([1.0, 0.6, -0.2, 0.3])
    z = draws(rounds, 5)
    noise = BandedNoise(from_table(z), torch.from_numpy(c))
    got = np.stack([noise.next().numpy() for _ in range(rounds)])
    Z = np.stack([z[(0, t)] for t in range(rounds)])
    np.testing.assert_allclose(got, np.linalg.solve(banded_matrix(c, rounds), Z), rtol=0, atol=1e-12)
    assert noise.state_dict()["history"].shape == (len(c) - 1, 5)


def _covariance_z_scores(samples, covariance):
    """|empirical - prescribed| over the standard error of each entry (Gaussian: var = S_ii S_jj + S_ij^2, / M)."""
    m = samples.shape[1]
    empirical = samples @ samples.T / m
    se = np.sqrt((np.outer(np.diag(covariance), np.diag(covariance)) + covariance**2) / m)
    return np.abs(empirical - covariance) / se


@pytest.mark.parametrize("mechanism", ["tree", "tree_efficient", "banded"])
def test_the_noise_over_the_rounds_has_the_covariance_the_factorization_prescribes(mechanism):
    """Each coordinate of the noise vectors is one independent draw of the T rounds' noise: 20,000 draws at once."""
    rounds, size = 12, 20_000
    settings = CorrelatedNoise(mechanism, bands=3 if mechanism == "banded" else None)
    settings.prepare(CyclicParticipation(3), 6, rounds)
    noise = settings.noise(seed=7, size=size)
    samples = np.stack([noise.next().numpy() for _ in range(rounds)])
    if mechanism == "banded":
        inverse = np.linalg.inv(banded_matrix(settings.coefficients.numpy(), rounds))
        prescribed = inverse @ inverse.T
    else:  # the reference map applied to unit draws, node by node
        nodes = tree_nodes(rounds)
        columns = [tree_reference({m: np.array([float(m == n)]) for m in nodes}, rounds, mechanism == "tree_efficient")[:, 0]
                   for n in nodes]  # fmt: skip
        L = np.stack(columns, axis=1)
        prescribed = L @ L.T
    assert _covariance_z_scores(samples, prescribed).max() < 5.0
    assert _covariance_z_scores(samples, np.eye(rounds)).max() > 10.0  # independent noise would be told apart


# ---- sensitivity, epsilon, the banded matrix ---------------------------------------------------------
def reference_sensitivity(C, release, groups, rounds, t):
    """max over the groups' patterns of ||C_released x_pattern|| (C >= 0 or no shared rows: exact)."""
    rows = np.array(release) < t
    best = 0.0
    for g in range(groups):
        x = np.zeros(rounds)
        x[g:rounds:groups] = 1.0
        best = max(best, float(np.linalg.norm(C[rows] @ x)))
    return best


def tree_dense(rounds, period=None):
    nodes = tree_nodes(rounds, period)
    C = np.zeros((len(nodes), rounds))
    for r, (h, f) in enumerate(nodes):
        C[r, f : f + (1 << h)] = 1.0
    return C, [f + (1 << h) - 1 for h, f in nodes]


@pytest.mark.parametrize("mechanism, groups, rounds, restart", [("tree", 1, 9, None), ("tree_efficient", 3, 20, None), ("tree", 32, 32, None),
                                                                ("tree", 3, 20, 3), ("tree", 4, 23, 6), ("banded", 4, 37, None),
                                                                ("banded", 1, 10, None)])  # fmt: skip
def test_sensitivity_and_epsilon_match_an_independent_computation(mechanism, groups, rounds, restart):
    settings = CorrelatedNoise(mechanism, noise_multiplier=3.0, delta=1e-5, restart=restart)
    settings.prepare(CyclicParticipation(groups), 2 * groups, rounds)
    if mechanism == "banded":
        C, release = banded_matrix(settings.coefficients.numpy(), rounds), list(range(rounds))
    else:
        C, release = tree_dense(rounds, restart)
    expected = [reference_sensitivity(C, release, groups, rounds, t) for t in range(1, rounds + 1)]
    np.testing.assert_allclose(settings.sensitivity, expected, rtol=0, atol=1e-12)
    if mechanism != "banded" and groups >= rounds:  # one participation: sqrt(ceil(log2(T + 1))) (Kairouz et al.)
        assert settings.sensitivity[-1] == pytest.approx(math.sqrt(math.ceil(math.log2(rounds + 1))), abs=1e-12)
    if restart == groups and rounds % groups == 0:  # one participation per tree, E trees: group 0's leaf 0 in each
        assert settings.sensitivity[-1] == pytest.approx(math.sqrt(rounds // groups * math.ceil(math.log2(groups + 1))), abs=1e-12)
    if mechanism == "banded":  # bands <= separation, no participation in the last b - 1 rounds: sqrt(k) max column norm
        k, full = math.ceil(rounds / groups), np.linalg.norm(C, axis=0).max()
        if (k - 1) * groups <= rounds - groups:
            assert settings.sensitivity[-1] == pytest.approx(math.sqrt(k) * full, abs=1e-12)
    for t in (1, rounds // 2, rounds):
        mu = settings.noise_multiplier / expected[t - 1]
        eps = []
        for a in RDP_ORDERS:  # the Gaussian's RDP a / (2 mu^2), Balle et al. 2020's conversion
            r = a / (2 * mu**2)
            eps.append(0.0 if 1e-10 + math.expm1(-r) > 0 else r + math.log1p(-1 / a) - math.log(1e-5 * a) / (a - 1))
        assert settings.epsilon(t) == pytest.approx(max(0.0, min(eps)), abs=1e-9)


def test_the_banded_matrix_minimises_the_prefix_sums_error_at_unit_column_norm():
    rounds, bands = 40, 5
    c = banded_toeplitz(bands, rounds).numpy()
    assert np.linalg.norm(c) == pytest.approx(1.0, abs=1e-14)
    C = banded_matrix(c, rounds)
    A = np.tril(np.ones((rounds, rounds)))
    error = np.linalg.norm(A @ np.linalg.inv(C)) ** 2 * np.linalg.norm(C, axis=0).max() ** 2
    assert prefix_error(c, rounds)[0] == pytest.approx(error, rel=1e-10)
    assert error < 0.6 * rounds * (rounds + 1) / 2  # independent noise (C = I): ||A||_F^2
    start = np.array([math.comb(2 * j, j) / 4.0**j for j in range(bands)])
    assert error < prefix_error(start, rounds)[0]
    other = np.array([1.0, 0.5, 0.3, -0.1])  # the gradient against central differences of a dense numpy error
    dense = [np.linalg.norm(A @ np.linalg.inv(banded_matrix(other + h * np.eye(4)[j], rounds))) ** 2 * np.sum((other + h * np.eye(4)[j]) ** 2)
             for j in range(4) for h in (1e-6, -1e-6)]  # fmt: skip
    np.testing.assert_allclose(prefix_error(other, rounds)[1], (np.array(dense[0::2]) - np.array(dense[1::2])) / 2e-6, rtol=1e-6)
    assert np.abs(prefix_error(c, rounds)[1][1:]).max() < 1e-6 * error  # stationary in every free coefficient


# ---- the round stage ----------------------------------------------------------------------------------
def _data(groups=2):
    return FederatedDataModule(dataset="synthetic", dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1},
                               num_clients=8, partition=IID(), participation=CyclicParticipation(groups))  # fmt: skip


def _module(privacy=None, execution="sequential"):
    torch.manual_seed(0)
    return FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), FedAvgM(global_lr=0.5, momentum=0.9),
                           LocalTraining(lr=0.1, steps=3, batch_size=8), privacy=privacy, execution=execution)  # fmt: skip


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_noise_zero_is_the_plain_algorithm_under_the_schedule_bitwise(tmp_path, execution, stacked_sizes):
    plain = _module(execution=execution)
    tiny_trainer(tmp_path / "a", 3).fit(plain, datamodule=_data())
    for mechanism in ("tree_efficient", "banded"):
        private = _module(CorrelatedNoise(mechanism, clip_norm=1e6, noise_multiplier=0.0), execution)
        trainer = tiny_trainer(tmp_path / mechanism, 3)
        trainer.fit(private, datamodule=_data())
        assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), private.model.parameters()))
        assert float(trainer.callback_metrics["privacy/epsilon"]) == math.inf
    noised = _module(CorrelatedNoise("banded", clip_norm=1e6, noise_multiplier=0.1), execution)
    tiny_trainer(tmp_path / "noised", 3).fit(noised, datamodule=_data())
    assert not torch.equal(next(plain.model.parameters()), next(noised.model.parameters()))
    if execution == "batched":
        assert stacked_sizes and max(stacked_sizes) == 4  # the cohort of 4 trained as one stack
    else:
        assert not stacked_sizes


@pytest.mark.parametrize("mechanism", ["tree_efficient", "banded"])
def test_resume_is_bitwise_with_the_noise_state_in_the_checkpoint(tmp_path, mechanism):
    def run(path, rounds, ckpt=None):
        horizon = {"horizon": 4} if mechanism == "banded" else {}  # the 2-round run's matrix is the 4-round run's
        module = _module(CorrelatedNoise(mechanism, clip_norm=0.5, noise_multiplier=0.5, **horizon))
        checkpoint = ModelCheckpoint(dirpath=path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        tiny_trainer(path, rounds, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, datamodule=_data(), ckpt_path=ckpt)
        return module

    straight, resumed = assert_resumes_bitwise(run, tmp_path, min_clients=0)  # FedAvgM keeps no client state
    a, b = (m.rounds.stage("privacy").noise.state_dict() for m in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("participation, privacy, line", [
    (UniformSampling(4), CorrelatedNoise("tree"), "data.participation must be CyclicParticipation (groups=1: every round), got UniformSampling"),
    (CyclicParticipation(2), CorrelatedNoise("banded", bands=3), "privacy.bands=3 exceeds CyclicParticipation.groups=2"),
])  # fmt: skip
def test_a_schedule_the_mechanism_does_not_assume_is_refused_in_one_line(tmp_path, participation, privacy, line):
    data = _data()
    data.participation = participation
    with pytest.raises(ValueError, match=re.escape(line)) as error:
        tiny_trainer(tmp_path, 2).fit(_module(privacy), datamodule=data)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("config", ["dpftrl_tree_digits", "dpftrl_banded_digits"])
def test_the_configs_fit_through_the_cli_and_log_epsilon(tmp_path, monkeypatch, config):
    import csv

    from fl_lightning.commands.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(ROOT / "configs" / f"{config}.yaml"), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--trainer.enable_progress_bar", "false"])  # fmt: skip
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    with open(metrics) as rows:
        epsilons = [float(r["privacy/epsilon"]) for r in csv.DictReader(rows) if r.get("privacy/epsilon")]
    assert len(epsilons) == 2 and 0 < epsilons[0] < epsilons[1] < math.inf

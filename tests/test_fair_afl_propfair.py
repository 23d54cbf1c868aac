"""AFL and PropFair (docs/algorithms.md 30, (30.6)-(30.12)) against independent float64 references written from their
papers, sequential and batched; AFL's simplex projection against a brute force; lambda across a checkpoint; both
configs through the CLI."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fl_lightning import algorithms
from fl_lightning.algorithms.afl import project_to_simplex
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.participation import UniformSampling
from fl_lightning.engine.module import FederatedModule
from models import MLP
from tests.conftest import (
    assert_resumes_bitwise,
    fit_checkpointed,
    tiny_datamodule,
    tiny_trainer,
)
from tests.test_loss_weighted import LR, ROUNDS, STEPS, fit_float64

_fit = fit_float64  # the float64 fit of the q-FFL and TERM tests, with the data's client_domains


def mean_ce(model, params, batch):
    inputs, target = batch
    return torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (inputs,)), target)


def gd(model, x, batch, objective):
    """STEPS full-batch gradient steps from x on objective(mean cross-entropy)."""
    w = {k: v.clone() for k, v in x.items()}
    for _ in range(STEPS):
        params = {k: v.requires_grad_() for k, v in w.items()}
        grads = torch.autograd.grad(objective(mean_ce(model, params, batch)), list(params.values()))
        w = {k: (v - LR * g).detach() for (k, v), g in zip(w.items(), grads)}
    return w


def simplex_by_bisection(v: np.ndarray) -> np.ndarray:
    """The projection onto the simplex as max(v - theta, 0) with sum 1, theta found by bisection (not by sorting)."""
    low, high = v.min() - 1.0, v.max()
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if np.maximum(v - mid, 0).sum() > 1 else (low, mid)
    return np.maximum(v - (low + high) / 2, 0)


def afl_reference(model, data, x, mixture, lambda_lr, domains):
    """Mohri et al.'s AFL round, every client: lambda_t weighs each client's update by lambda_d n_k / N_d, then lambda
    ascends the domains' mean losses at the broadcast model (projected gradient or exponentiated gradient)."""
    sizes = data.client_sizes.double()
    domains = torch.tensor(domains if domains is not None else range(data.num_clients))
    num_domains = int(domains.max()) + 1
    domain_sizes = torch.zeros(num_domains, dtype=torch.float64).index_add_(0, domains, sizes)
    lam = torch.full((num_domains,), 1.0 / num_domains, dtype=torch.float64)
    for _ in range(ROUNDS):
        step = {k: torch.zeros_like(v) for k, v in x.items()}
        total = 0.0
        losses = torch.zeros(num_domains, dtype=torch.float64)
        for cid in range(data.num_clients):
            batch = data.client_full_batch(cid)
            w = gd(model, x, batch, lambda f: f)
            d = int(domains[cid])
            beta = lam[d] * sizes[cid] / domain_sizes[d]
            for k in x:
                step[k] += beta * (w[k] - x[k])
            total += beta
            losses[d] += sizes[cid] * mean_ce(model, x, batch).detach() / domain_sizes[d]
        x = {k: x[k] + step[k] / total for k in x}
        if mixture == "projected":
            lam = torch.from_numpy(simplex_by_bisection((lam + lambda_lr * losses).numpy()))
        else:
            lam = lam * torch.exp(lambda_lr * losses) / (lam * torch.exp(lambda_lr * losses)).sum()
    return x, lam


AFL_CASES = [("projected", 4.0, None), ("exponentiated", 4.0, None), ("projected", 8.0, [0, 1, 1, 0])]


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("mixture, lambda_lr, domains", AFL_CASES, ids=["projected", "exponentiated", "projected-2-domains"])
def test_afl_matches_its_reference_in_float64(tmp_path, mixture, lambda_lr, domains, execution):
    algorithm = algorithms.AFL(mixture=mixture, lambda_lr=lambda_lr, domains="clients" if domains is None else "data")
    module, data, initial = _fit(tmp_path, algorithm, execution, domains)
    expected, lam = afl_reference(module.model, data, initial, mixture, lambda_lr, domains)
    for param, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[param], rtol=1e-12, atol=1e-12)
    got = module.server_state["mixture"]["lambda"]
    torch.testing.assert_close(got, lam, rtol=1e-12, atol=1e-12)
    assert float((lam - 1 / len(lam)).abs().max()) > 0.02  # lambda moved away from uniform
    if mixture == "projected" and domains is None:
        assert float(lam.min()) == 0.0  # the projection clipped a client: the boundary case is covered


def test_afl_with_lambda_fixed_is_fedavg_with_uniform_weights(tmp_path):
    """lambda_lr = 0 keeps lambda uniform: each update weighs 1/N / sum of 1/N = 1/S, FedAvg's uniform weighting (to
    float tolerance: the weights are normalised differently)."""
    ours, _, _ = _fit(tmp_path / "a", algorithms.AFL(lambda_lr=0))
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=3, hidden=[4]).double()
    fedavg = FederatedModule(model, algorithms.FedAvg(), LocalTraining(lr=LR, steps=STEPS, batch_size=None))
    data = tiny_datamodule(num_clients=4, dtype="float64")
    data.participation = UniformSampling(4, weighting="uniform")
    tiny_trainer(tmp_path / "f", ROUNDS, precision="64-true").fit(fedavg, datamodule=data)
    assert torch.equal(ours.server_state["mixture"]["lambda"], torch.full((4,), 0.25, dtype=torch.float64))
    for a, b in zip(ours.model.parameters(), fedavg.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def propfair_surrogate(f, baseline, epsilon, branches):
    """-log(M - f), Huberized: for M - f < epsilon its tangent at M - f = epsilon (Zhang et al., Eq. of PropFair)."""
    if baseline - f >= epsilon:
        branches.add("log")
        return -torch.log(baseline - f)
    branches.add("linear")
    return -math.log(epsilon) + (f - baseline + epsilon) / epsilon


def propfair_reference(model, data, x, baseline, epsilon):
    """Each round: every client runs STEPS full-batch GD on the surrogate of its mean loss; FedAvg with w_k = n_k / n."""
    sizes = data.client_sizes.double()
    weights = sizes / sizes.sum()
    branches = set()
    for _ in range(ROUNDS):
        new = {k: torch.zeros_like(v) for k, v in x.items()}
        for cid in range(data.num_clients):
            w = gd(model, x, data.client_full_batch(cid), lambda f: propfair_surrogate(f, baseline, epsilon, branches))
            for k in x:
                new[k] += weights[cid] * w[k]
        x = new
    return x, branches


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("baseline, branches", [(1.25, {"log", "linear"}), (5.0, {"log"})], ids=["M=1.25", "M=5"])
def test_propfair_matches_its_reference_in_float64(tmp_path, baseline, branches, execution):
    module, data, initial = _fit(tmp_path, algorithms.PropFair(baseline=baseline, epsilon=0.2), execution)
    expected, taken = propfair_reference(module.model, data, initial, baseline, 0.2)
    assert taken == branches  # at M = 1.25 some steps take the Huberized (linear) branch
    for param, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[param], rtol=1e-12, atol=1e-12)


def test_the_simplex_projection_is_the_nearest_point_of_the_simplex():
    """Against a brute force over supports (the nearest feasible point on each face) and against bisection."""
    rng = np.random.default_rng(0)
    for v in [rng.normal(size=5) * scale for scale in (0.1, 1.0, 10.0) for _ in range(20)] + [np.full(4, 0.25), np.array([3.0, -1.0, 0.5])]:
        best = None
        for r in range(1, len(v) + 1):
            for support in itertools.combinations(range(len(v)), r):
                w = np.zeros_like(v)
                w[list(support)] = v[list(support)] - (v[list(support)].sum() - 1) / r
                if w.min() >= 0 and (best is None or np.sum((w - v) ** 2) < np.sum((best - v) ** 2)):
                    best = w
        got = project_to_simplex(torch.from_numpy(v)).numpy()
        np.testing.assert_allclose(got, best, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got, simplex_by_bisection(v), rtol=0, atol=1e-12)


def test_afl_lambda_survives_a_checkpoint(tmp_path):
    """4 rounds straight == 2 rounds, checkpoint, resume to 4: the model and lambda bit for bit."""

    def run(folder, rounds, ckpt_path=None):
        torch.manual_seed(0)
        module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[4]), algorithms.AFL(mixture="exponentiated", lambda_lr=2.0),
                                 LocalTraining(lr=0.1, steps=2, batch_size=8))  # fmt: skip
        return fit_checkpointed(module, folder, rounds, tiny_datamodule(num_clients=6, clients_per_round=3), ckpt_path)

    straight, resumed = assert_resumes_bitwise(run, tmp_path, min_clients=0)
    lam = straight.server_state["mixture"]["lambda"]
    assert lam.shape == (6,) and float((lam - 1 / 6).abs().max()) > 0.01
    assert torch.equal(lam, resumed.server_state["mixture"]["lambda"])


def test_settings_are_refused_in_one_line(tmp_path):
    refusals = [
        (lambda: algorithms.AFL(mixture="mirror"), r"AFL mixture must be one of projected, exponentiated, got 'mirror'"),
        (lambda: algorithms.AFL(lambda_lr=-1), r"AFL lambda_lr must be a number >= 0, got -1"),
        (lambda: algorithms.AFL(domains="labels"), r"AFL domains must be one of clients, data, got 'labels'"),
        (lambda: algorithms.PropFair(baseline=0), r"PropFair baseline must be a number > 0, got 0"),
        (lambda: algorithms.PropFair(baseline=1.0, epsilon=1.0), r"PropFair epsilon must be in \(0, baseline=1.0\), got 1.0"),
    ]
    for make, message in refusals:
        with pytest.raises(ValueError, match=f"^{message}$"):
            make()
    with pytest.raises(ValueError, match=r"AFL domains: data reads FederatedDataModule.client_domains, which it does not define"):
        _fit(tmp_path, algorithms.AFL(domains="data"))
    with pytest.raises(ValueError, match=r"AFL client_domains must hold 4 integers in \[0, D\), each of 0..D-1 used"):
        _fit(tmp_path, algorithms.AFL(domains="data"), domains=[0, 2, 2, 0])

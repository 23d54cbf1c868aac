"""FedFV and FedMGDA+ (docs/algorithms.md 30, (30.13)-(30.20)) against independent float64 references of their papers'
rules, sequential and batched; their degenerate settings bitwise; the min-norm solver against an exhaustive one and
scipy; FedFV's update history through a checkpoint; both configs through the CLI."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fl_lightning import algorithms
from fl_lightning.algorithms.min_norm import min_norm_weights
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.participation import UniformSampling
from fl_lightning.engine.module import FederatedModule
from models import MLP
from tests.conftest import (
    assert_resumes_bitwise,
    fit_checkpointed,
    tiny_datamodule,
    tiny_module,
    tiny_trainer,
)

LR, STEPS, ROUNDS = 0.3, 3, 3


def _fit(tmp_path, algorithm, execution="sequential", clients_per_round=4, weighting="samples"):
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=3, hidden=[4]).double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = FederatedModule(model, algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=None), execution=execution)
    data = tiny_datamodule(num_clients=4, dtype="float64")
    data.participation = UniformSampling(clients_per_round, weighting=weighting)
    tiny_trainer(tmp_path, ROUNDS, precision="64-true").fit(module, datamodule=data)
    if execution == "batched":
        assert not module.executor.fallbacks  # stacked, not run client by client
    return module, data, initial


def loss_of(model, params, batch):
    inputs, target = batch
    return torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (inputs,)), target)


def dot(a, b):
    return sum((a[k] * b[k]).sum() for k in a)


def local_round(model, data, x, t):
    """Round t's plan, and for each of its clients: w_k after STEPS full-batch GD steps from x, and F_k(x)."""
    plan = data.participation.plan(t, data.client_sizes, data.seed)
    out = []
    for cid in plan.clients.tolist():
        batch = data.client_full_batch(cid)
        w = {k: v.clone() for k, v in x.items()}
        for _ in range(STEPS):
            grads = torch.autograd.grad(loss_of(model, {k: v.requires_grad_() for k, v in w.items()}, batch), list(w.values()))
            w = {k: (v - LR * g).detach() for (k, v), g in zip(w.items(), grads)}
        out.append((cid, w, loss_of(model, x, batch).detach()))
    return plan.weights.tolist(), out


def fedfv_reference(model, data, x, alpha, tau, counts):
    """Alg. 1 of Wang et al. (2021) as its released code runs it, by hand; ``counts`` tallies the projections."""
    history = {}  # client -> (its latest g, the round of it)
    for t in range(ROUNDS):
        weights, clients = local_round(model, data, x, t)
        grads = [{k: x[k] - w[k] for k in x} for _, w, _ in clients]
        losses = [float(f) for _, _, f in clients]
        for (cid, _, _), g in zip(clients, grads):
            history[cid] = (g, t)
        order = sorted(range(len(grads)), key=lambda i: losses[i])  # ascending loss
        keep = order[math.ceil((len(order) - 1) * (1 - alpha)) :] if alpha > 0 else []
        projected = []
        for i, g_i in enumerate(grads):
            g_i = dict(g_i)
            for j in order if i not in keep else []:
                d = dot(g_i, grads[j])
                if j != i and d < 0:
                    g_i = {k: g_i[k] - d / dot(grads[j], grads[j]) * grads[j][k] for k in x}
                    counts["internal"] += 1
            projected.append(g_i)
        g = {k: sum(w * p[k] for w, p in zip(weights, projected)) for k in x}
        if tau and t >= tau:
            for s in range(t - tau + 1, t + 1):  # oldest round first, this one last
                conflicting = [h for h, r in history.values() if r == s and dot(g, h) < 0]
                if conflicting:
                    g_con = {k: sum(h[k] for h in conflicting) for k in x}
                    d = dot(g, g_con)
                    if d < 0:
                        g = {k: g[k] - d / dot(g_con, g_con) * g_con[k] for k in x}
                        counts["external"] += 1
        plain = {k: sum(w * gr[k] for w, gr in zip(weights, grads)) for k in x}
        scale = torch.sqrt(dot(plain, plain)) / torch.sqrt(dot(g, g))
        x = {k: x[k] - scale * g[k] for k in x}
    return x


def exhaustive_min_norm(gram, epsilon):
    """(30.18) by trying every assignment of the weights to free / lower bound / upper bound (numpy): the feasible
    KKT point of least objective."""
    m = len(gram)
    lower, upper = max(0.0, 1 / m - epsilon), min(1.0, 1 / m + epsilon)
    best = (np.inf, None)
    for sides in itertools.product((0, -1, 1), repeat=m):
        free, fixed = [i for i in range(m) if sides[i] == 0], [i for i in range(m) if sides[i] != 0]
        if not free:
            continue
        lam = np.array([lower if s < 0 else upper if s > 0 else 0.0 for s in sides])
        n = len(free)
        kkt = np.block([[2 * gram[np.ix_(free, free)], np.ones((n, 1))], [np.ones((1, n)), np.zeros((1, 1))]])
        rhs = np.concatenate([-2 * gram[np.ix_(free, fixed)] @ lam[fixed], [1 - lam[fixed].sum()]])
        lam[free] = np.linalg.solve(kkt, rhs)[:n]
        if lam.min() >= lower - 1e-14 and lam.max() <= upper + 1e-14 and lam @ gram @ lam < best[0]:
            best = (lam @ gram @ lam, lam)
    return best[1]


def fedmgda_reference(model, data, x, epsilon, global_lr, lambdas):
    """Alg. 1 of Hu et al. (2022) by hand: normalised updates, lambda from ``exhaustive_min_norm``, w += eta sum lambda u."""
    for t in range(ROUNDS):
        _, clients = local_round(model, data, x, t)
        units = []
        for _, w, _ in clients:
            d = {k: w[k] - x[k] for k in x}
            units.append({k: v / torch.sqrt(dot(d, d)) for k, v in d.items()})
        gram = np.array([[float(dot(a, b)) for b in units] for a in units])
        lam = exhaustive_min_norm(gram, epsilon)
        lambdas.append(lam)
        x = {k: x[k] + global_lr * sum(float(lam_i) * u[k] for lam_i, u in zip(lam, units)) for k in x}
    return x


FEDFV = [(0.0, 0), (0.5, 1), (0.1, 2)]


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("alpha, tau", FEDFV, ids=[f"alpha={a},tau={t}" for a, t in FEDFV])
def test_fedfv_matches_its_reference_in_float64(tmp_path, alpha, tau, execution):
    """3 of 4 clients a round, weights by size: the round-2 step reads a client of round 1 when tau = 2."""
    module, data, initial = _fit(tmp_path, algorithms.FedFV(alpha=alpha, tau=tau), execution, clients_per_round=3)
    counts = {"internal": 0, "external": 0}
    expected = fedfv_reference(module.model, data, initial, alpha, tau, counts)
    assert counts["internal"] > 0 and (counts["external"] > 0) == (tau > 0), counts  # the projections ran
    for name, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("epsilon", [0.05, 0.3, 1.0])
def test_fedmgda_matches_its_reference_in_float64(tmp_path, epsilon, execution):
    module, data, initial = _fit(tmp_path, algorithms.FedMGDAPlus(epsilon=epsilon, global_lr=0.5), execution)
    lambdas = []
    expected = fedmgda_reference(module.model, data, initial, epsilon, 0.5, lambdas)
    assert any(np.abs(lam - 0.25).max() > 1e-3 for lam in lambdas)  # the weights moved off uniform
    for name, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-12, atol=1e-12)


class NormalisedFedAvg(algorithms.FedAvg):
    """FedAvg whose clients upload d_k / ||d_k||."""

    elementwise = False

    def client_finish(self, params, local, ctx):
        delta = {k: params[k] - ctx.broadcast["x"][k] for k in params}
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in delta.values()))
        return {"delta": {k: v / norm for k, v in delta.items()}}, ctx.client_state


class VmappedFedAvg(algorithms.FedAvg):
    """FedAvg whose batched clients run under vmap, as FedFV's (its elementwise rule, run once on the stacked
    tensors, rounds differently)."""

    elementwise = False


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_degenerate_settings_are_fedavg_bitwise(tmp_path, execution):
    """FedMGDA+ at epsilon = 0: FedAvg on normalised updates, weights 1/m (30.20); FedFV at alpha = 1, tau = 0:
    nothing projected, FedAvg."""
    pairs = [
        (algorithms.FedMGDAPlus(epsilon=0.0), NormalisedFedAvg(), "uniform"),
        (algorithms.FedFV(alpha=1.0, tau=0), algorithms.FedAvg() if execution == "sequential" else VmappedFedAvg(), "samples"),
    ]
    for i, (ours, fedavg, weighting) in enumerate(pairs):
        a, _, _ = _fit(tmp_path / f"a{i}", ours, execution, weighting=weighting)
        b, _, _ = _fit(tmp_path / f"b{i}", fedavg, execution, weighting=weighting)
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q), type(ours).__name__


def test_min_norm_weights_match_an_exhaustive_search_and_scipy():
    """m <= 5 (generic, so lambda is unique): every working set tried, to 1e-12. m = 30: scipy's SLSQP reaches no
    lower objective (1e-12), and lambda agrees to its tolerance (1e-6) where it is unique (d > m)."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(0)
    for _ in range(25):
        m = int(rng.integers(2, 6))
        units = rng.normal(size=(m, m + 3))
        units /= np.linalg.norm(units, axis=1, keepdims=True)
        gram, epsilon = units @ units.T, float(rng.choice([0.01, 0.1, 0.3, 1.0]))
        lam = min_norm_weights(torch.from_numpy(gram), epsilon).numpy()
        np.testing.assert_allclose(lam, exhaustive_min_norm(gram, epsilon), rtol=0, atol=1e-12)
    for d in (40, 10):
        units = rng.normal(size=(30, d))
        units /= np.linalg.norm(units, axis=1, keepdims=True)
        gram, lower, upper = units @ units.T, 0.0, 1 / 30 + 0.05
        lam = min_norm_weights(torch.from_numpy(gram), 0.05).numpy()
        assert abs(lam.sum() - 1) < 1e-14 and lam.min() >= lower and lam.max() <= upper
        ref = minimize(lambda v, g=gram: v @ g @ v, np.full(30, 1 / 30), jac=lambda v, g=gram: 2 * g @ v, method="SLSQP",
                       bounds=[(lower, upper)] * 30, constraints=[{"type": "eq", "fun": lambda v: v.sum() - 1}],
                       options={"ftol": 1e-16, "maxiter": 1000})  # fmt: skip
        assert lam @ gram @ lam <= ref.fun + 1e-12
        if d > 30:
            np.testing.assert_allclose(lam, ref.x, rtol=0, atol=1e-6)


def test_fedfv_history_survives_a_checkpoint(tmp_path):
    """tau = 2: 4 rounds straight == 2 rounds + checkpoint + resume to 4, bitwise, the kept updates included."""

    def run(path, rounds, ckpt_path=None):
        return fit_checkpointed(tiny_module(algorithms.FedFV(alpha=0.1, tau=2)), path, rounds, tiny_datamodule(num_clients=6, clients_per_round=3), ckpt_path)

    straight, resumed = assert_resumes_bitwise(run, tmp_path, min_clients=0)
    assert len(straight.server_state["fedfv_seen"]["client"]) > 0
    for name, td in straight.server_state.items():
        for key, value in td.items():
            assert torch.equal(value, resumed.server_state[name][key]), f"{name}/{key}"


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"FedFV alpha must be a number in \[0, 1\], got 1.5"):
        algorithms.FedFV(alpha=1.5)
    with pytest.raises(ValueError, match=r"FedFV tau must be an int >= 0, got -1"):
        algorithms.FedFV(tau=-1)
    with pytest.raises(ValueError, match=r"FedMGDAPlus epsilon must be a number in \[0, 1\], got -0.1"):
        algorithms.FedMGDAPlus(epsilon=-0.1)

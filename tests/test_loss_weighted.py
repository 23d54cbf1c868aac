"""The fairness rules (fl_lightning/algorithms/loss_weighted.py, docs/algorithms.md 30): q-FFL and client-level
TERM against independent float64 references of their papers' rules, sequential and batched; at 0 each is FedAvg
bitwise; every fairness config (these, AFL, PropFair, FedFV, FedMGDA+) fits through the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from fl_lightning import algorithms
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.participation import UniformSampling
from fl_lightning.engine.module import FederatedModule
from models import MLP
from tests.conftest import fit_shipped_config, tiny_datamodule, tiny_trainer

LR, STEPS, ROUNDS = 0.3, 3, 2


def fit_float64(tmp_path, algorithm, execution="sequential", domains=None):
    """ROUNDS rounds of 4 clients in float64, full-batch local steps, weights by size (``domains``: the data's
    ``client_domains``); batched execution checked to have stacked every round. (module, data, initial parameters)."""
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=3, hidden=[4]).double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = FederatedModule(model, algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=None), execution=execution)
    data = tiny_datamodule(num_clients=4, dtype="float64")
    data.participation = UniformSampling(4, weighting="samples")
    if domains is not None:
        data.client_domains = domains
    tiny_trainer(tmp_path, ROUNDS, precision="64-true").fit(module, datamodule=data)
    if execution == "batched":
        assert not module.executor.fallbacks and module.executor.stats["stacked_rounds"] == ROUNDS  # stacked, not client by client
    return module, data, initial


def loss_of(model, params, batch):
    inputs, target = batch
    return torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (inputs,)), target)


def local_rounds(model, data, x, server_step):
    """ROUNDS rounds in which every client runs STEPS full-batch GD steps from x; ``server_step(x, clients)`` is the
    rule's step from each client's (weight w_k = n_k / n, w_bar_k, F_k(x))."""
    sizes = data.client_sizes.double()
    weights = sizes / sizes.sum()
    for _ in range(ROUNDS):
        clients = []
        for cid in range(data.num_clients):
            batch = data.client_full_batch(cid)
            w = {k: v.clone() for k, v in x.items()}
            for _ in range(STEPS):
                grads = torch.autograd.grad(loss_of(model, {k: v.requires_grad_() for k, v in w.items()}, batch), list(w.values()))
                w = {k: (v - LR * g).detach() for (k, v), g in zip(w.items(), grads)}
            clients.append((weights[cid], w, loss_of(model, x, batch).detach()))
        x = server_step(x, clients)
    return x


def qffl_reference(model, data, x, q):
    """Alg. 2 of Li et al. (2020) by hand: every client, full-batch GD, L = 1 / lr, weights w_k = n_k / n."""

    def step(x, clients):
        lipschitz = 1.0 / LR
        numerator = {k: torch.zeros_like(v) for k, v in x.items()}
        denominator = torch.zeros((), dtype=torch.float64)
        for weight, w, f in clients:
            delta_w = {k: lipschitz * (x[k] - w[k]) for k in x}  # Delta w_k = L (w^t - w_bar_k)
            norm2 = sum((v**2).sum() for v in delta_w.values())
            for k in x:
                numerator[k] += weight * f**q * delta_w[k]
            denominator += weight * (q * f ** (q - 1) * norm2 + lipschitz * f**q)
        return {k: x[k] - numerator[k] / denominator for k in x}

    return local_rounds(model, data, x, step)


def term_reference(model, data, x, tilt):
    """Each round: x <- sum_k w_k e^{t F_k(x)} w_bar_k / sum_k w_k e^{t F_k(x)}."""

    def step(x, clients):
        tilted = [(weight * torch.exp(tilt * f), w) for weight, w, f in clients]
        total = sum(t for t, _ in tilted)
        return {k: sum(t * w[k] for t, w in tilted) / total for k in x}

    return local_rounds(model, data, x, step)


CASES = [(f"QFFL q={q}", lambda q=q: algorithms.QFFL(q=q), lambda m, d, x, q=q: qffl_reference(m, d, x, q)) for q in (0.5, 1.0, 5.0)] + [
    (f"TERM t={t}", lambda t=t: algorithms.TERM(tilt=t), lambda m, d, x, t=t: term_reference(m, d, x, t)) for t in (-1.0, 1.0, 5.0)
]  # fmt: skip


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("name, make, reference", CASES, ids=[c[0] for c in CASES])
def test_the_rule_matches_its_reference_in_float64(tmp_path, name, make, reference, execution):
    module, data, initial = fit_float64(tmp_path, make(), execution)
    if execution == "batched":
        assert not module.executor.fallbacks  # stacked, not run client by client
    expected = reference(module.model, data, initial)
    for param, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[param], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", [lambda: algorithms.QFFL(q=0), lambda: algorithms.TERM(tilt=0)], ids=["QFFL q=0", "TERM t=0"])
def test_at_zero_the_rule_is_fedavg_bitwise(tmp_path, make):
    ours, _, _ = fit_float64(tmp_path / "a", make())
    fedavg, _, _ = fit_float64(tmp_path / "f", algorithms.FedAvg())
    for a, b in zip(ours.model.parameters(), fedavg.model.parameters()):
        assert torch.equal(a, b)


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"QFFL q must be a number >= 0, got -1"):
        algorithms.QFFL(q=-1)
    with pytest.raises(ValueError, match=r"QFFL lipschitz must be > 0"):
        algorithms.QFFL(lipschitz=0.0)
    with pytest.raises(ValueError, match=r"TERM tilt must be a finite number, got inf"):
        algorithms.TERM(tilt=float("inf"))


@pytest.mark.parametrize("config", ["qffl_digits", "term_digits", "afl_digits", "propfair_digits", "fedfv_digits", "fedmgda_digits"])
def test_the_fairness_configs_fit_through_the_cli_and_log_the_spread_across_clients(tmp_path, monkeypatch, config):
    rows = fit_shipped_config(tmp_path, monkeypatch, config)
    spread = [r for r in rows if r.get("val/personal_acc_var")]
    assert spread and all(0 <= float(r["val/personal_acc_var"]) <= 0.25 for r in spread)  # a variance of accuracies in [0, 1]
    assert float(spread[-1]["val/personal_acc_best10"]) >= float(spread[-1]["val/personal_acc_worst10"])
    if config == "afl_digits":  # lambda over the 20 clients: its entropy at most log 20, its largest weight above 1/20
        logged = [r for r in rows if r.get("algo/lambda_entropy")]
        assert logged and all(0 <= float(r["algo/lambda_entropy"]) < math.log(20) for r in logged)
        assert all(1 / 20 < float(r["algo/lambda_max"]) <= 1 for r in logged)
    if config == "propfair_digits":
        assert any(r.get("train/loss/propfair") for r in rows)

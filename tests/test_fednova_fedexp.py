"""FedNova and FedExP against an independent float64 numpy reference with clients running different
numbers of local steps (stragglers, epochs), sequential and batched; their reductions (E16, E17)."""

from itertools import islice

import numpy as np
import pytest
import torch

from datamodules import Dirichlet, FederatedDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import FedAvg, FedExP, FedNova
from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.experiments.testing import one_round
from models import LinearLeastSquares
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROUNDS, LR, D = 4, 0.05, 5


def _data():
    return FederatedDataModule(
        dataset="least_squares",
        dataset_args={"num_agents": 6, "samples_per_agent": 20, "num_features": D, "theta_spread": 2.0, "feature_shift": 2.0,
                      "seed": 3},  # heterogeneous enough that FedExP extrapolates every round
        num_clients=6,
        partition=Dirichlet(0.5, min_size=6),
        participation=UniformSampling(4),
        dtype="float64",
        seed=5,
    )


def _local(mode):
    return LocalTraining(lr=LR, steps=6, batch_size=4) if mode == "steps" else LocalTraining(lr=LR, steps=None, epochs=1, batch_size=4)


def _run(tmp_path, algorithm, mode, execution, faults):
    data = _data()
    model = LinearLeastSquares(D, bias=True, init=0.5).double()
    module = FederatedModule(model, algorithm, _local(mode), execution=execution, faults=faults)
    tiny_trainer(tmp_path, ROUNDS).fit(module, datamodule=data)
    w = module.model.linear
    return np.concatenate([w.weight.detach().numpy().ravel(), w.bias.detach().numpy()]), data, module


def _reference(data, local, faults, rule, momentum=0.0, eps=1e-3):
    """Rounds written out in numpy: theta = (w, b), f(theta; q, y) = 0.5 mean((q w + b - y)^2).

    Data access (plans, the clients' minibatches, stragglers' budgets) is the framework's; the
    local steps, the normalization and the extrapolated step are this function's own. Returns the final
    theta, every round's K_i and (FedExP) every round's eta_g."""
    theta = np.full(D + 1, 0.5)
    steps_seen, etas = [], []
    for t in range(ROUNDS):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        deltas, ks, ws = [], [], []
        for cid, seed, w in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            k = data.num_local_steps(cid, local.batch_size, local.steps, local.epochs)
            if faults.active:
                _, k = faults.draw(seed, k)
            th, v = theta.copy(), np.zeros(D + 1)
            for q, y in islice(data.client_batches(cid, seed, local.batch_size, local.steps, local.epochs), k):
                q, y = q.numpy(), y.numpy()
                r = q @ th[:D] + th[D] - y
                g = np.concatenate([q.T @ r, [r.sum()]]) / len(y)
                v = momentum * v + g
                th = th - LR * v
            deltas.append(th - theta)
            ks.append(k)
            ws.append(w)
        steps_seen.append(ks)
        ws = np.array(ws)
        if rule == "fednova":
            a = np.array([(k - momentum * (1 - momentum**k) / (1 - momentum)) / (1 - momentum) for k in ks])
            tau = (ws * a).sum()
            theta = theta + tau * sum(wi / ai * d for wi, ai, d in zip(ws, a, deltas))
        else:
            mean = sum(wi * d for wi, d in zip(ws, deltas))
            eta = max(1.0, sum(wi * (d @ d) for wi, d in zip(ws, deltas)) / (2 * (mean @ mean + eps)))
            etas.append(eta)
            theta = theta + eta * mean
    return theta, steps_seen, etas


CASES = [  # (rule, momentum, mode, faults)
    ("fednova", 0.0, "steps", ClientFaults(straggler=0.2)),
    ("fednova", 0.9, "steps", ClientFaults(straggler=0.2)),
    ("fednova", 0.5, "epochs", ClientFaults()),
    ("fedexp", 0.0, "steps", ClientFaults(straggler=0.2)),
    ("fedexp", 0.0, "epochs", ClientFaults()),
]


# docs/algorithms.md, (21.1)-(21.3), (22.1)-(22.2)
@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("rule, momentum, mode, faults", CASES, ids=[f"{c[0]}-rho{c[1]}-{c[2]}" for c in CASES])
def test_matches_the_numpy_reference_with_unequal_local_steps(tmp_path, rule, momentum, mode, faults, execution):
    algorithm = FedNova(momentum=momentum) if rule == "fednova" else FedExP(eps=1e-3)
    ours, data, module = _run(tmp_path, algorithm, mode, execution, faults)
    ref, steps, etas = _reference(data, _local(mode), faults, rule, momentum)
    assert any(len(set(k)) > 1 for k in steps), "the clients of some round must run different numbers of steps"
    diff = float(np.abs(ours - ref).max())
    assert diff < 1e-13, diff
    assert float(np.abs(ref - 0.5).max()) > 1e-2  # the rounds moved the model
    if rule == "fedexp":
        assert min(etas) >= 1.0 and max(etas) > 1.05  # the server extrapolated
    if execution == "batched" and mode == "steps":  # every round ran stacked, stragglers' steps masked (epochs' short
        # last batches would need padded rows, which regression targets cannot mask)
        assert not module.executor.inner.fallbacks and module.executor.inner.stats["stacked_rounds"] == ROUNDS


@pytest.mark.parametrize("rule", ["fednova", "fedexp"])
def test_batched_with_every_round_stacked_matches_the_reference(tmp_path, rule):
    algorithm = FedNova(momentum=0.9) if rule == "fednova" else FedExP(eps=1e-3)
    ours, data, module = _run(tmp_path, algorithm, "steps", "batched", ClientFaults())
    ref, _, _ = _reference(data, _local("steps"), ClientFaults(), rule, 0.9 if rule == "fednova" else 0.0)
    assert not module.executor.inner.fallbacks
    assert float(np.abs(ours - ref).max()) < 1e-13


def test_the_reference_tells_fednova_from_fedavg():
    """With unequal K_i the normalization changes the result (the reference is not vacuous)."""
    data, local, faults = _data(), _local("steps"), ClientFaults(straggler=0.2)
    data.setup()
    nova, _, _ = _reference(data, local, faults, "fednova")
    avg, _, _ = _reference(data, local, faults, "fedexp", eps=1e300)  # eta_g = 1: FedAvg
    assert np.abs(nova - avg).max() > 1e-3


# docs/algorithms.md, E16
def test_fednova_with_equal_steps_and_plain_sgd_is_fedavg(tmp_path):
    local = LocalTraining(lr=0.1, steps=3, batch_size=8)
    out = {}
    for name, algorithm in (("nova", FedNova()), ("avg", FedAvg())):
        module = tiny_module(algorithm, local)
        tiny_trainer(tmp_path, 3).fit(module, datamodule=tiny_datamodule())
        out[name] = [p.detach() for p in module.model.parameters()]
    for a, b in zip(out["nova"], out["avg"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fednova_normalizes_by_each_clients_steps_hand_worked():
    """Two clients, fixed gradients g1 = 1 for K1 = 1 step, g2 = 2 for K2 = 3 steps, lr 0.1, w = 1/2:
    Delta = (-0.1, -0.6), ||a|| = (1, 3), tau_eff = 2, d = -2 (0.5 (-0.1) + 0.5 (-0.6 / 3)) = 0.3
    (FedAvg: 0.35)."""
    x = {"w": torch.tensor([1.0], dtype=torch.float64)}
    g1, g2 = ({"w": torch.tensor([v], dtype=torch.float64)} for v in (1.0, 2.0))
    r = one_round(FedNova(), x, [[g1], [g2, g2, g2]], lr=0.1)
    torch.testing.assert_close(r.uploads[1]["delta"]["w"], torch.tensor([-0.6], dtype=torch.float64))
    torch.testing.assert_close(r.pseudo_grad["w"], torch.tensor([0.3], dtype=torch.float64))
    torch.testing.assert_close(r.x["w"], torch.tensor([0.7], dtype=torch.float64))
    avg = one_round(FedAvg(), x, [[g1], [g2, g2, g2]], lr=0.1)
    torch.testing.assert_close(avg.pseudo_grad["w"], torch.tensor([0.35], dtype=torch.float64))
    momentum = one_round(FedNova(momentum=0.5), x, [[g1], [g2, g2, g2]], lr=0.1)
    # v: 2, 3, 3.5 -> Delta_2 = -0.85; ||a_2|| = (3 - 0.5 (1 - 0.125) / 0.5) / 0.5 = 4.25; tau = (1 + 4.25) / 2
    torch.testing.assert_close(momentum.uploads[1]["delta"]["w"], torch.tensor([-0.85], dtype=torch.float64))
    torch.testing.assert_close(momentum.pseudo_grad["w"], torch.tensor([2.625 * 0.15], dtype=torch.float64))


# docs/algorithms.md, E17
def test_fedexp_step_on_a_hand_worked_two_client_case():
    """Delta_1 = (3, 0), Delta_2 = (-1, 0), w = 1/2: mean (1, 0), sum_i w_i ||Delta_i||^2 = 5,
    eta_g = max(1, 5 / (2 (1 + eps))) = 2.4975..., pseudo-gradient -eta_g (1, 0)."""
    x = {"w": torch.zeros(2, dtype=torch.float64)}
    grads = [[{"w": torch.tensor([-30.0, 0.0], dtype=torch.float64)}], [{"w": torch.tensor([10.0, 0.0], dtype=torch.float64)}]]
    r = one_round(FedExP(eps=1e-3), x, grads, lr=0.1)
    eta = 5.0 / (2.0 * (1.0 + 1e-3))
    assert float(r.server_state["fedexp"]["step_size"]) == pytest.approx(eta, rel=1e-15)
    torch.testing.assert_close(r.pseudo_grad["w"], torch.tensor([-eta, 0.0], dtype=torch.float64), rtol=1e-15, atol=0)
    same = one_round(FedExP(eps=1e-3), x, [grads[0], grads[0]], lr=0.1)  # identical clients: ratio 1/2 -> step 1
    assert float(same.server_state["fedexp"]["step_size"]) == 1.0
    torch.testing.assert_close(same.pseudo_grad["w"], torch.tensor([-3.0, 0.0], dtype=torch.float64))


def test_fedexp_step_is_at_least_one_every_round(tmp_path):
    module = tiny_module(FedExP(), LocalTraining(lr=0.1, steps=3, batch_size=8))
    steps = []
    module.algorithm.metrics = lambda state, info, f=module.algorithm.metrics: steps.append(f(state, info)["step_size"]) or {}
    tiny_trainer(tmp_path, 4).fit(module, datamodule=tiny_datamodule())
    assert len(steps) == 4 and min(steps) >= 1.0 and max(steps) > 1.0


@pytest.mark.parametrize("make, message", [(lambda: FedNova(momentum=1.0), "momentum"), (lambda: FedExP(eps=0.0), "eps")])
def test_bad_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()



@pytest.mark.parametrize("config, name", [("fednova_digits.yaml", "FedNova"), ("fedexp_digits.yaml", "FedExP")])
def test_the_digits_configs_run(tmp_path, config, name):
    """The shipped configs, 2 rounds (FedNova's: one local epoch, so clients run different step counts)."""
    from pathlib import Path

    from fl_lightning.commands.cli import build_cli

    root = Path(__file__).resolve().parents[1]
    cli = build_cli(
        ["--config", str(root / "configs" / config), "--trainer.max_steps", "2", "--trainer.logger", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
         "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path)],
        run=False,
    )  # fmt: skip
    assert type(cli.model.algorithm).__name__ == name
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    if name == "FedNova":
        data = cli.datamodule
        assert len({data.num_local_steps(c, 20, None, 1) for c in range(data.num_clients)}) > 1


def test_neither_declares_a_linear_aggregate():
    """Both aggregates read per-client quantities (K_i, ||Delta_i||^2) beside the uploads' sum: DDP gathers."""
    from fl_lightning.algorithms.base import declares_capability

    assert not declares_capability(FedNova(), "linear_aggregate") and not declares_capability(FedExP(), "linear_aggregate")
    assert declares_capability(FedNova(), "elementwise") and declares_capability(FedExP(), "elementwise")

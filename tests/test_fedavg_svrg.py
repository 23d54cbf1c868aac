"""FedAvg-SVRG (Rostami & Kia, Alg. 1): the client rule, its GD limit, the step-count check, the config."""

import numpy as np
import pytest
import torch

from datamodules import IID
from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import ClientContext, FedAvgSVRG, RoundInfo
from models import MLP
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


def _quadratic_client(a: np.ndarray, b: np.ndarray, picks: list[int], lr: float, snapshots: int, inner: int):
    """Run the algorithm's client rule on f_i(w) = 0.5 (a_i . w - b_i)^2 with the given sample picks."""
    algo = FedAvgSVRG(snapshots=snapshots, inner_steps=inner)
    A, B = torch.tensor(a), torch.tensor(b)

    def grad_on(idx):
        def grad(params):
            w = params["w"]
            r = A[idx] @ w - B[idx]
            return 0.5 * (r**2).mean(), {"w": A[idx].T @ r / len(idx)}

        return grad

    x = {"w": torch.full((a.shape[1],), 0.5, dtype=torch.float64)}
    ctx = ClientContext(0, {"x": x}, {}, RoundInfo(round=0, local_lr=lr, num_clients=1), snapshots * inner)
    ctx.full_grad = lambda params: grad_on(list(range(len(b))))(params)[1]
    params = {"w": x["w"].clone()}
    local = algo.client_init(params, ctx)
    for step, i in enumerate(picks):
        ctx.step, ctx.grad = step, grad_on([i])
        params, local = algo.client_step(params, local, ctx)
    return params["w"].numpy()


def _reference_svrg(a, b, picks, lr, snapshots, inner):
    """Alg. 1 lines 7-18, written out in numpy."""
    w = np.full(a.shape[1], 0.5)
    t = 0
    for _ in range(snapshots):
        snap = w.copy()
        mu = a.T @ (a @ snap - b) / len(b)
        for _ in range(inner):
            i = picks[t]
            v = a[i] * (a[i] @ w - b[i]) - a[i] * (a[i] @ snap - b[i]) + mu
            w = w - lr * v
            t += 1
    return w


def test_client_rule_matches_algorithm_1():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 4)), rng.normal(size=12)
    S, M, lr = 3, 4, 0.05
    picks = rng.integers(0, 12, S * M).tolist()
    ours = _quadratic_client(a, b, picks, lr, S, M)
    np.testing.assert_allclose(ours, _reference_svrg(a, b, picks, lr, S, M), rtol=1e-12, atol=1e-12)
    # a rule without the correction (plain SGD on the picks) is measurably different
    w = np.full(4, 0.5)
    for i in picks:
        w = w - lr * a[i] * (a[i] @ w - b[i])
    assert np.abs(ours - w).max() > 1e-3


# docs/algorithms.md, E8
def test_svrg_with_one_inner_step_and_full_batches_is_gradient_descent(tmp_path):
    """M = 1: every step is a snapshot, v = mu~ = full local gradient, so K steps of SVRG are K steps of
    full-batch GD: the same run as FedAvg with batch_size = None, bit for bit."""
    out = {}
    for name, algo, batch in (("svrg", FedAvgSVRG(snapshots=3, inner_steps=1), 4), ("gd", FedAvg(), None)):
        data = tiny_datamodule(num_clients=4, clients_per_round=4, partition=IID())
        module = tiny_module(algo, LocalTraining(lr=0.2, steps=3, batch_size=batch))
        tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=data)
        out[name] = [p.detach() for p in module.model.parameters()]
    for a, b in zip(out["svrg"], out["gd"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("local, given", [(dict(steps=5), "local.steps=5"), (dict(steps=None, epochs=1), "local.epochs=1")])
def test_local_steps_must_equal_snapshots_times_inner_steps(tmp_path, local, given, execution):
    """Refused before any round runs (no client trained, no batched fallback logged), naming the setting."""
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedAvgSVRG(snapshots=2, inner_steps=3), LocalTraining(lr=0.1, batch_size=4, **local),
                             execution=execution)  # fmt: skip
    with pytest.raises(ValueError, match=rf"snapshots \* inner_steps = 2 \* 3 = 6 local steps per client, but {given}; set local.steps = 6"):
        tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule(num_clients=4, clients_per_round=2))
    assert module.rounds.rounds_run == 0 and not getattr(module.executor.inner, "fallbacks", None)


@pytest.mark.parametrize("kwargs, message", [({"snapshots": 0}, "snapshots"), ({"inner_steps": 0}, "inner_steps")])
def test_bad_svrg_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FedAvgSVRG(**kwargs)


def test_inv_sqrt_local_lr_schedule():
    local = LocalTraining(lr=1.0, lr_schedule="inv_sqrt")
    assert [local.lr_at(k) for k in (0, 3, 99)] == [1.0, 0.5, 0.1]
    assert LocalTraining(lr=0.1).lr_at(5) == 0.1  # default unchanged: exponential with decay 1
    with pytest.raises(ValueError, match="local.lr_decay must be 1 with lr_schedule 'inv_sqrt'"):
        LocalTraining(lr_decay=0.9, lr_schedule="inv_sqrt")
    with pytest.raises(ValueError, match="local.lr_schedule must be"):
        LocalTraining(lr_schedule="linear")  # cosine and step exist since issue 16

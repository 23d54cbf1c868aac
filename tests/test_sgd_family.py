"""SGD-family algorithms: exact reductions to FedAvg/FedCM, SCAFFOLD's control variates, server optimizers."""

import pytest
import torch

from fl_lightning import LocalTraining
from fl_lightning.core import params as P
from fl_lightning.algorithms import (
    SCAFFOLD,
    ClientContext,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedCM,
    FedDyn,
    FedMIM,
    FedProx,
    FedSAM,
    FedYogi,
    RoundInfo,
)
from fl_lightning.algorithms import increments as H
from fl_lightning.optim import Yogi
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

LOCAL = LocalTraining(lr=0.1, lr_decay=0.9, steps=3, batch_size=8)


def _fit(tmp_path, algorithm, rounds=3, local=LOCAL, num_clients=6, clients_per_round=3):
    module = tiny_module(algorithm, local)
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=tiny_datamodule(num_clients, clients_per_round))
    return module


def _params(module):
    return [p.detach().clone() for p in module.model.parameters()]


@pytest.fixture(scope="module")
def fedavg_params(tmp_path_factory):
    return _params(_fit(tmp_path_factory.mktemp("fedavg"), FedAvg()))


# docs/algorithms.md, E1
@pytest.mark.parametrize(
    "algorithm",
    [
        FedMIM(inertial_steps=1, alpha=[0.0], beta=[0.0]),
        FedMIM(inertial_steps=2, alpha=[0.0, 0.0], beta=[0.0, 0.0]),
        FedCM(a=1.0),
        FedProx(mu=0.0),
        FedSAM(rho=0.0),
        FedAvgM(momentum=0.0),
    ],
    ids=["FedMIM-J1", "FedMIM-J2", "FedCM", "FedProx", "FedSAM", "FedAvgM"],
)
def test_degenerate_settings_equal_fedavg_bitwise(tmp_path, fedavg_params, algorithm):
    for a, b in zip(_params(_fit(tmp_path, algorithm)), fedavg_params):
        assert torch.equal(a, b)


# docs/algorithms.md, E1
@pytest.mark.parametrize(
    "algorithm",
    [FedMIM(), FedCM(a=0.5), FedProx(mu=0.5), FedSAM(rho=0.5), FedAvgM(momentum=0.9), SCAFFOLD(), FedDyn(alpha=0.1)],
    ids=["FedMIM", "FedCM", "FedProx", "FedSAM", "FedAvgM", "SCAFFOLD", "FedDyn"],
)
def test_active_settings_differ_from_fedavg(tmp_path, fedavg_params, algorithm):
    """The reductions above are not vacuous: the same run with the rule switched on moves elsewhere."""
    moved = _params(_fit(tmp_path, algorithm))
    assert all(torch.isfinite(p).all() for p in moved)
    assert max(float((a - b).abs().max()) for a, b in zip(moved, fedavg_params)) > 1e-4


# docs/algorithms.md, E2
def test_fedmim_one_step_without_beta_equals_fedcm(tmp_path):
    """J = 1, beta = 0: x - alpha delta - (1 - alpha) eta g == x - eta ((1 - alpha) g + alpha Delta), Delta = delta/eta."""
    mim = _params(_fit(tmp_path / "mim", FedMIM(inertial_steps=1, alpha=[0.3], beta=[0.0]), rounds=4))
    cm = _params(_fit(tmp_path / "cm", FedCM(a=0.7), rounds=4))
    for a, b in zip(mim, cm):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fedmim_history_and_shifts_follow_the_global_increments():
    """Server state over a sequence of global models: shifts are sum_j w_j delta_{t-j}, delta_t = -(x_t - x_{t-1})/K_{t-1}."""
    alg = FedMIM(inertial_steps=2, alpha=[0.6, 0.3], beta=[0.9, 0.1])
    xs = [{"w": torch.tensor([float(t**2), -2.0 * t])} for t in range(4)]
    steps = [2.0, 4.0, 5.0]
    state = alg.server_state_init(P.detach_clone(xs[0]))
    seen = []
    for t in range(4):
        info = RoundInfo(round=t, local_lr=0.1, num_clients=10)
        seen.append(alg.broadcast(xs[t], state, info))
        if t < 3:
            _, state = alg.aggregate(xs[t], [{"delta": P.sub(xs[t + 1], xs[t])}], torch.ones(1), state, info, [steps[t]])
    delta = [torch.zeros(2)] + [-(xs[t]["w"] - xs[t - 1]["w"]) / steps[t - 1] for t in range(1, 4)]
    for t in range(4):
        older = delta[t - 1] if t >= 1 else torch.zeros(2)
        torch.testing.assert_close(seen[t]["shift_alpha"]["w"], 0.6 * delta[t] + 0.3 * older)
        torch.testing.assert_close(seen[t]["shift_beta"]["w"], 0.9 * delta[t] + 0.1 * older)


def test_fedmim_takes_the_gradient_at_the_beta_shifted_point():
    alg = FedMIM(inertial_steps=1, alpha=[0.5], beta=[0.25])
    points = []

    def grad(params):
        points.append(P.detach_clone(params))
        return torch.zeros(()), {"w": torch.tensor([1.0, 1.0])}

    x = {"w": torch.tensor([1.0, 2.0])}
    broadcast = {"x": x, "shift_alpha": {"w": torch.tensor([0.2, 0.0])}, "shift_beta": {"w": torch.tensor([0.0, 0.4])}}
    ctx = ClientContext(0, broadcast, {}, RoundInfo(0, 0.1, 1), num_steps=1, grad=grad)
    new, _ = alg.client_step(P.detach_clone(x), {}, ctx)
    assert len(points) == 1  # one gradient per local step
    torch.testing.assert_close(points[0]["w"], torch.tensor([1.0, 1.6]))
    torch.testing.assert_close(new["w"], torch.tensor([1.0 - 0.2 - 0.05, 2.0 - 0.05]))


class RecordingSCAFFOLD(SCAFFOLD):
    """SCAFFOLD that records the raw minibatch gradients of each client's latest round."""

    def __init__(self):
        super().__init__()
        self.raw = {}

    def client_init(self, params, ctx):
        self.raw[ctx.client_id] = []
        return {}

    def client_step(self, params, local, ctx):
        inner = ctx.grad

        def recording(p):
            loss, g = inner(p)
            self.raw[ctx.client_id].append(P.detach_clone(g))
            return loss, g

        ctx.grad = recording
        return super().client_step(params, local, ctx)


# docs/algorithms.md, E3
def test_scaffold_control_variates_are_mean_raw_gradients_and_c_is_their_mean(tmp_path):
    alg = RecordingSCAFFOLD()
    module = _fit(tmp_path, alg, rounds=3, num_clients=10, clients_per_round=2)
    seen = module.store.client_ids()
    assert 3 <= len(seen) < 10, "test needs some clients never sampled"
    for cid in seen:
        c_i = module.store.get(cid, dict)["c"]
        mean_grad = P.mean(alg.raw[cid])
        for name in c_i:
            torch.testing.assert_close(c_i[name], mean_grad[name], rtol=1e-4, atol=1e-5)
    # c = (1/N) sum over all N clients; the unseen hold c_i = 0
    c_sum = P.weighted_sum([module.store.get(cid, dict)["c"] for cid in seen], [1.0 / 10] * len(seen))
    for name, c in module.server_state["c"].items():
        torch.testing.assert_close(c, c_sum[name], rtol=1e-5, atol=1e-7)


# docs/algorithms.md, E4
def test_fedadam_first_round_is_normalised_fedavg_step(tmp_path):
    """Bias-corrected Adam's first step: x1 = x0 - eta d / (|d| + tau) with d FedAvg's pseudo-gradient."""
    local = LocalTraining(lr=0.1, steps=2, batch_size=8)
    x0 = _params(tiny_module(FedAvg(), local))
    avg = _params(_fit(tmp_path / "avg", FedAvg(), rounds=1, local=local))
    for alg in (FedAdam(global_lr=0.03, tau=1e-2), FedYogi(global_lr=0.03, tau=1e-2)):
        adam = _params(_fit(tmp_path / type(alg).__name__, alg, rounds=1, local=local))
        for p0, pa, pd in zip(x0, avg, adam):
            d = p0 - pa
            torch.testing.assert_close(pd, p0 - 0.03 * d / (d.abs() + 1e-2), rtol=1e-5, atol=1e-6)


def test_yogi_second_moment_moves_additively():
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = Yogi([p], lr=0.1, betas=(0.5, 0.9), eps=1e-3)
    g1, g2 = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 3.0])
    m = v = torch.zeros(2)
    x = p.detach().clone()
    for t, g in enumerate((g1, g2), start=1):
        p.grad = g.clone()
        opt.step()
        m = 0.5 * m + 0.5 * g
        v = v - 0.1 * torch.sign(v - g * g) * g * g
        x = x - 0.1 * (m / (1 - 0.5**t)) / ((v / (1 - 0.9**t)).sqrt() + 1e-3)
        torch.testing.assert_close(p.detach(), x)


def test_fedavgm_uses_heavy_ball_on_the_server():
    alg = FedAvgM(global_lr=0.5, momentum=0.8, nesterov=True)
    opt = alg.server_optimizer([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["momentum"] == 0.8 and opt.defaults["nesterov"] and opt.defaults["lr"] == 0.5


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FedMIM(inertial_steps=2, alpha=[0.5], beta=[0.1, 0.1]), "alpha must have inertial_steps=2 entries"),
        (lambda: FedMIM(inertial_steps=1, alpha=[0.5], beta=[0.1, 0.1]), "beta must have inertial_steps=1 entries"),
        (lambda: FedMIM(inertial_steps=2, alpha=[0.6, 0.4], beta=[0.1, 0.1]), "alpha must sum to < 1"),
        (lambda: FedMIM(inertial_steps=1, alpha=[-0.1], beta=[0.1]), "alpha entries must be >= 0"),
        (lambda: FedMIM(inertial_steps=1, alpha=[0.1], beta=[-0.1]), "beta entries must be >= 0"),
        (lambda: FedMIM(inertial_steps=0, alpha=[], beta=[]), "inertial_steps must be >= 1"),
        (lambda: FedCM(a=0.0), "FedCM a must be in \\(0, 1\\]"),
        (lambda: FedProx(mu=-1.0), "FedProx mu must be >= 0"),
        (lambda: FedSAM(rho=-1.0), "FedSAM rho must be >= 0"),
        (lambda: FedDyn(alpha=0.0), "FedDyn alpha must be > 0"),
        (lambda: FedAdam(tau=0.0), "FedAdam tau must be > 0"),
        (lambda: FedAdam(betas=(0.9, 1.0)), "FedAdam betas must be two values in \\[0, 1\\)"),
        (lambda: FedAvgM(momentum=1.0), "FedAvgM momentum must be in \\[0, 1\\)"),
    ],
)
def test_bad_settings_are_rejected_with_their_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_fedmim_resume_restores_the_increment_history_bitwise(tmp_path):
    """3 rounds + checkpoint + resume to 5 == 5 rounds straight (the history lives in the checkpointed server state)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt_path=None):
        module = tiny_module(FedMIM(), LOCAL)
        checkpoint = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=tiny_datamodule(6, 3), ckpt_path=ckpt_path)
        return module

    straight = run(tmp_path / "a", 5)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "c", 5, ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    for a, b in zip(_params(straight), _params(resumed)):
        assert torch.equal(a, b)
    assert set(straight.server_state) == {"x_prev", "steps", "delta_1"}
    for name, td in straight.server_state.items():
        for key, value in td.items():
            assert torch.equal(value, resumed.server_state[name][key])

"""LocalAdam, FAdamET, FAdamGT, FedLADA (FAdam paper, Algorithm 1): rule, state, tracking subset, cost."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from fl_lightning.core import params as P
from fl_lightning.algorithms import FAdamET, FAdamGT, FedLADA, LocalAdam
from fl_lightning.algorithms.base import ClientContext, RoundInfo
from fl_lightning.algorithms.tracking import TrackingSubset
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.participation import RoundPlan, derive_seed
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


# ---- a bare round loop over the Algorithm API, for problems with analytic gradients --------------------

def _stored(store):
    """Every stored client's state, ``{client_id: state}`` (the store's public reads)."""
    return {c: store.get(c, dict) for c in store.client_ids()}

def full_plan(round_idx: int, num_clients: int) -> RoundPlan:
    seeds = torch.tensor([derive_seed(0, round_idx, c) for c in range(num_clients)])
    return RoundPlan(round_idx, torch.arange(num_clients), torch.full((num_clients,), 1.0 / num_clients, dtype=F64), seeds)


def run_rounds(algorithm, grads, x, rounds, lr, steps=3, states=None, server=None, record=None):
    """Full participation; ``grads[c](params) -> grad dict``. Returns (x, client states, server state)."""
    states = {} if states is None else states
    server = algorithm.server_state_init(x) if server is None else server
    for t in range(rounds):
        plan = full_plan(t, len(grads))
        info = RoundInfo(t, lr, len(grads), plan=plan)
        broadcast = algorithm.broadcast(x, server, info)
        uploads = []
        for c, grad in enumerate(grads):
            seen = [] if record is not None else None

            def grad_fn(p, grad=grad, seen=seen):
                g = grad(p)
                if seen is not None:
                    seen.append(g)
                return torch.zeros(()), g

            ctx = ClientContext(c, broadcast, states.get(c) or algorithm.client_state_init(x), info, steps, grad=grad_fn)
            params = P.detach_clone(x)
            local = algorithm.client_init(params, ctx)
            for k in range(steps):
                ctx.step = k
                params, local = algorithm.client_step(params, local, ctx)
            upload, states[c] = algorithm.client_finish(params, local, ctx)
            uploads.append(upload)
            if record is not None:
                record[c] = seen
        pseudo_grad, server = algorithm.aggregate(x, uploads, plan.weights, server, info, [steps] * len(uploads))
        x = P.add(x, pseudo_grad, -algorithm.global_lr)
    return x, states, server


def heterogeneous_quadratics(num_clients=4, dim=5):
    """f_i(x) = 0.5 (x - c_i)^T diag(h_i) (x - c_i); the optimum of their mean is sum h_i c_i / sum h_i."""
    gen = torch.Generator().manual_seed(0)
    h = torch.rand(num_clients, dim, generator=gen, dtype=F64) * 4 + 0.5
    c = torch.randn(num_clients, dim, generator=gen, dtype=F64) * 2
    grads = [lambda p, i=i: {"w": h[i] * (p["w"] - c[i])} for i in range(num_clients)]
    return grads, (h * c).sum(0) / h.sum(0)


# docs/algorithms.md, E14
def test_fadam_gt_reaches_the_optimum_within_lr_while_local_adam_stalls():
    grads, x_star = heterogeneous_quadratics()
    lr = 1e-2
    dist = {}
    for algorithm in (FAdamGT(tracking=1.0), LocalAdam()):
        x, _, _ = run_rounds(algorithm, grads, {"w": torch.zeros(5, dtype=F64)}, rounds=400, lr=lr)
        dist[type(algorithm).__name__] = float((x["w"] - x_star).norm())
    assert dist["FAdamGT"] < lr, dist
    assert dist["LocalAdam"] > 50 * lr, dist  # the fixed point of mean_i g_i/sqrt(v_i) = 0, not of mean_i g_i = 0


# docs/algorithms.md, E15 (and section 19)
def test_fadam_et_settles_where_the_clients_adam_directions_average_to_zero_not_at_the_optimum():
    grads, x_star = heterogeneous_quadratics()
    lr = 1e-2
    x, states, _ = run_rounds(FAdamET(tracking=1.0), grads, {"w": torch.zeros(5, dtype=F64)}, rounds=400, lr=lr)
    g = torch.stack([grad(x)["w"] for grad in grads])
    preconditioned = g / (torch.stack([states[c]["v"]["w"] for c in range(len(grads))]).sqrt() + 1e-8)
    assert float((x["w"] - x_star).norm()) > 50 * lr  # far from the optimum (about 1.09 here)
    assert float(g.mean(0).norm()) > 1.0  # the mean gradient is not zero there ...
    assert float(preconditioned.mean(0).norm()) < 0.05 * float(preconditioned.norm(dim=1).mean())  # ... its Adam-scaled mean is


def reference_adam_directions(gs, v0, betas=(0.9, 0.99), eps=1e-8):
    """The paper's lines 13-16, written out: m from 0, v and v_hat from the persisted v_i."""
    m, v, v_hat, out = torch.zeros_like(v0), v0.clone(), v0.clone(), []
    for g in gs:
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        v_hat = torch.maximum(v_hat, v)
        out.append(m / (v_hat.sqrt() + eps))
    return out, v


# docs/algorithms.md, E11
def test_fadam_et_tracking_term_is_the_mean_adam_direction_of_the_round():
    grads, _ = heterogeneous_quadratics()
    algorithm = FAdamET(tracking=1.0)
    x, states, server = run_rounds(algorithm, grads, {"w": torch.zeros(5, dtype=F64)}, rounds=2, lr=0.05)
    assert float(server["y"]["w"].abs().sum()) > 0  # the shift y - y_i is non-zero in the round checked
    for state in states.values():  # a large persisted v_i decays within the round: v_hat (the max) != v
        state["v"] = {"w": state["v"]["w"] + 100.0}
    before = {c: {n: dict(td) for n, td in s.items()} for c, s in states.items()}
    record = {}
    run_rounds(algorithm, grads, x, rounds=1, lr=0.05, states=states, server=server, record=record)
    for c, gs in record.items():
        directions, v_end = reference_adam_directions([g["w"] for g in gs], before[c]["v"]["w"])
        torch.testing.assert_close(states[c]["y"]["w"], torch.stack(directions).mean(0), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(states[c]["v"]["w"], v_end, rtol=0, atol=0)  # v_i <- v (not v_hat)


# docs/algorithms.md, E11
def test_fadam_gt_tracking_term_is_the_mean_raw_gradient_and_server_y_is_the_mean_of_all_y_i():
    grads, _ = heterogeneous_quadratics()
    algorithm = FAdamGT(tracking=1.0)
    x, states, server = run_rounds(algorithm, grads, {"w": torch.zeros(5, dtype=F64)}, rounds=2, lr=0.05)
    record = {}
    _, states, server = run_rounds(algorithm, grads, x, rounds=1, lr=0.05, states=states, server=server, record=record)
    for c, gs in record.items():
        torch.testing.assert_close(states[c]["y"]["w"], torch.stack([g["w"] for g in gs]).mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(server["y"]["w"], torch.stack([s["y"]["w"] for s in states.values()]).mean(0))


# ---- through the real round loop ---------------------------------------------------------------------------
class StoreHistory(L.Callback):
    """Snapshot of the client store and the active clients after every round."""

    def __init__(self) -> None:
        self.stores, self.clients = [], []

    def on_train_batch_end(self, trainer, module, outputs, plan, batch_idx) -> None:
        self.stores.append({c: {n: P.detach_clone(td) for n, td in s.items()} for c, s in _stored(module.store).items()})
        self.clients.append(set(plan.clients.tolist()))


class SpyLocalAdam(LocalAdam):
    def __init__(self) -> None:
        super().__init__()
        self.started_with = []  # (round, client, v at the start of its local training)

    def client_init(self, params, ctx):
        self.started_with.append((ctx.info.round, ctx.client_id, P.detach_clone(ctx.client_state["v"])))
        return super().client_init(params, ctx)


def test_second_moment_persists_for_a_client_and_is_untouched_for_clients_not_sampled(tmp_path):
    algorithm, history = SpyLocalAdam(), StoreHistory()
    data = tiny_datamodule(num_clients=6, clients_per_round=3)
    tiny_trainer(tmp_path, rounds=5, callbacks=[history]).fit(tiny_module(algorithm), datamodule=data)
    resumed = 0
    for t, client, v in algorithm.started_with:
        if t == 0 or client not in history.stores[t - 1]:
            assert all(float(u.abs().sum()) == 0 for u in v.values())
        else:
            resumed += 1
            assert all(torch.equal(v[k], history.stores[t - 1][client]["v"][k]) for k in v)
    assert resumed > 0, "no client was sampled twice; pick another seed"
    for t in range(1, 5):
        for client, state in history.stores[t - 1].items():
            if client not in history.clients[t]:
                after = history.stores[t][client]["v"]
                assert all(torch.equal(state["v"][k], after[k]) for k in after)
            else:
                assert any(not torch.equal(state["v"][k], history.stores[t][client]["v"][k]) for k in state["v"])


@pytest.mark.parametrize("tracking, refreshed", [(0, 0), (0.5, 2), (4, 4)])
def test_only_the_tracking_subset_refreshes_y_and_pays_for_it(tmp_path, tracking, refreshed):
    history, rounds, clients_per_round = StoreHistory(), 3, 4
    module = tiny_module(FAdamGT(tracking=tracking))
    tiny_trainer(tmp_path, rounds=rounds, callbacks=[history]).fit(module, datamodule=tiny_datamodule(6, clients_per_round))
    zero = lambda td: all(float(t.abs().sum()) == 0 for t in td.values())  # noqa: E731
    for t in range(rounds):
        prev = history.stores[t - 1] if t else {}
        changed = [
            c for c in history.clients[t]
            if not all(torch.equal(history.stores[t][c]["y"][k], prev[c]["y"][k]) if c in prev else zero(history.stores[t][c]["y"])
                       for k in history.stores[t][c]["y"])
        ]
        assert len(changed) == refreshed
    y_server = module.server_state["y"]
    if refreshed == 0:
        assert zero(y_server)
    sum_y = P.weighted_sum([s["y"] for s in _stored(module.store).values()], [1.0 / 6] * len(module.store))
    for k in y_server:
        torch.testing.assert_close(y_server[k], sum_y[k])  # y = (1/N) sum_i y_i over the whole population
    # Per active client and round: x and y down, delta up, y_i+ - y_i up for the Y/S that refresh.
    model_bytes = P.num_bytes(module.global_params().values())
    sent = module.comm_totals["bytes_up"] + module.comm_totals["bytes_down"]
    assert sent / (model_bytes * clients_per_round) == pytest.approx(rounds * (3 + refreshed / clients_per_round))


def test_tracking_subset_is_a_function_of_seed_and_round():
    spec = TrackingSubset(0.5)
    plan = lambda seed, t: RoundPlan(  # noqa: E731
        t, torch.arange(10, 20), torch.full((10,), 0.1, dtype=F64), torch.tensor([derive_seed(seed, t, c) for c in range(10, 20)])
    )
    chosen = spec.select(plan(0, 3))
    assert chosen == spec.select(plan(0, 3)) and len(chosen) == 5 and chosen <= set(range(10, 20))
    assert len({spec.select(plan(s, t)) for s in range(3) for t in range(3)}) > 1


def test_tracking_larger_than_the_active_set_is_rejected(tmp_path):
    module = tiny_module(FAdamGT(tracking=4))
    with pytest.raises(ValueError, match="algorithm tracking=4 exceeds the 3 active clients of the round; allowed range is 0..3"):
        tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule(6, 3))
    assert module.trainer.global_step == 0


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FAdamET(tracking=1.5), "algorithm tracking as a fraction of the active clients must be in \\[0, 1\\]"),
        (lambda: FAdamGT(tracking=-1), "algorithm tracking must be >= 0"),
        (lambda: LocalAdam(beta2=1.0), "algorithm beta2 must be in \\[0, 1\\)"),
        (lambda: LocalAdam(eps=0.0), "algorithm eps must be > 0"),
        (lambda: FedLADA(a=1.5), "algorithm a .* must be in \\[0, 1\\]"),
    ],
)
def test_invalid_adam_settings_are_rejected_with_their_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# docs/algorithms.md, E7
def test_fedlada_with_a_one_is_local_adam_bit_for_bit(tmp_path):
    modules = []
    for algorithm in (FedLADA(a=1.0), LocalAdam()):
        module = tiny_module(algorithm)
        tiny_trainer(tmp_path, rounds=3).fit(module, datamodule=tiny_datamodule())
        modules.append(module)
    lada, adam = modules
    for p, q in zip(lada.model.parameters(), adam.model.parameters()):
        assert torch.equal(p, q)
    assert lada.store.equal(adam.store)


def test_fedlada_broadcasts_the_last_global_increment_per_local_step(tmp_path):
    module = tiny_module(FedLADA(a=0.5))
    before = P.detach_clone(module.global_params())
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule())
    increment = P.sub(module.global_params(), before)
    expected = P.scale(increment, -1.0 / (module.local.steps * module.local.lr))
    for k, g_a in module.server_state["g_a"].items():
        torch.testing.assert_close(g_a, expected[k])
        assert float(g_a.abs().sum()) > 0


@pytest.mark.parametrize("name", ["local_adam", "fedlada", "fadam_et", "fadam_gt"])
def test_digits_configs_fit_through_the_cli(tmp_path, monkeypatch, name):
    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    args = ["--config", str(ROOT / "configs" / f"{name}_digits.yaml"), "--trainer.max_steps", "2",
            "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", f"--trainer.default_root_dir={tmp_path}"]
    cli = build_cli(args, run=False)
    before = P.detach_clone(cli.model.global_params())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = cli.model.global_params()
    assert cli.trainer.global_step == 2
    assert all(torch.isfinite(after[k]).all() and not torch.equal(after[k], before[k]) for k in after)

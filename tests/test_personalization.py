"""Partial personalization: FedAvg-P, FedSim, FedAlt, Scaffold-P, personal tensors, metrics."""

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.func import functional_call

from datamodules import IID, Dirichlet, FederatedDataModule
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.core import params as P
from fl_lightning.algorithms import FedAlt, FedAvgP, FedSim, ScaffoldP
from fl_lightning.rounds.driver import WARMUP_STREAM as _WARMUP_STREAM
from fl_lightning.core.tasks import PERSONAL
from fl_lightning.core.objective import Objective
from fl_lightning.core.state import ClientStore
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.personal_eval import GradientNorm, PersonalizedEvaluation, worst_fraction_mean
from models import MLP, SplitLogistic
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


def binary_data(num_clients=5, clients_per_round=3, partition=None, **kw) -> FederatedDataModule:
    return FederatedDataModule(
        dataset="synthetic",
        dataset_args={"num_samples": 240, "num_features": 8, "num_classes": 2, "seed": 1},
        num_clients=num_clients,
        partition=partition if partition is not None else Dirichlet(0.5, min_size=8),
        participation=UniformSampling(clients_per_round),
        **kw,
    )


def split_module(algorithm, local=None, seed=0, rho=0.1) -> FederatedModule:
    torch.manual_seed(seed)
    model = SplitLogistic(in_features=8, shared_features=5, rho=rho)
    with torch.no_grad():  # a generic starting point, not the zero init
        model.u.normal_(0, 0.3)
        model.v.normal_(0, 0.3)
    return FederatedModule(model, algorithm, local or LocalTraining(lr=0.1, steps=3, batch_size=8), personal=["v"])


def params_of(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


# ---- equivalences with the unpersonalized algorithms -------------------------------------------------


# docs/algorithms.md, E5
def test_fedavgp_with_eta_one_and_no_personal_tensors_is_fedavg_bitwise(tmp_path):
    local = LocalTraining(lr=0.1, steps=3, batch_size=8, lr_decay=0.9)
    runs = {}
    for name, algorithm in {"fedavg": FedAvg(), "fedavgp": FedAvgP(eta_u=1.0, eta_v=1.0), "fedsim": FedSim()}.items():
        module = tiny_module(algorithm, local)
        tiny_trainer(tmp_path / name, rounds=4).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
        runs[name] = module
    for other in ("fedavgp", "fedsim"):
        for a, b in zip(runs["fedavg"].model.parameters(), runs[other].model.parameters()):
            assert torch.equal(a, b)
        assert runs["fedavg"].comm_totals == runs[other].comm_totals


def reference_scaffold(model, data, local, rounds, global_lr, warm_start):
    """SCAFFOLD option II written out plainly (Karimireddy et al. 2020, Alg. 1), optional Scaffold-P warm start."""
    data.setup()
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_clients = data.num_clients

    def grad(params, batch):
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        inputs, target = batch
        loss = F.cross_entropy(functional_call(model, leaves, (inputs,)), target)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    c = {k: torch.zeros_like(v) for k, v in x.items()}
    c_i = [dict(c) for _ in range(n_clients)]
    if warm_start:  # c_i^0 = (1/K) sum_k grad F(x^0; xi_k), c^0 = mean_i c_i^0
        for i in range(n_clients):
            seed = derive_seed(data.seed, i, _WARMUP_STREAM)
            grads = [grad(x, b) for b in data.client_batches(i, seed, local.batch_size, local.steps)]
            c_i[i] = {k: sum(g[k] for g in grads) / len(grads) for k in x}
        c = {k: sum(ci[k] for ci in c_i) / n_clients for k in x}
    for t in range(rounds):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        lr, K = local.lr_at(t), local.steps
        deltas, delta_cs = [], []
        for cid, seed, w in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            y = dict(x)
            for batch in data.client_batches(cid, seed, local.batch_size, K):
                g = grad(y, batch)
                y = {k: y[k] - lr * (g[k] - c_i[cid][k] + c[k]) for k in y}
            c_new = {k: c_i[cid][k] - c[k] + (x[k] - y[k]) / (K * lr) for k in x}
            deltas.append({k: w * (y[k] - x[k]) for k in x})
            delta_cs.append({k: c_new[k] - c_i[cid][k] for k in x})
            c_i[cid] = c_new
        x = {k: x[k] + global_lr * sum(d[k] for d in deltas) for k in x}
        c = {k: c[k] + sum(d[k] for d in delta_cs) / n_clients for k in x}
    return x, c, c_i


# docs/algorithms.md, E6
@pytest.mark.parametrize("warm_start", [False, True])
def test_scaffoldp_without_personal_tensors_is_scaffold(tmp_path, warm_start):
    local = LocalTraining(lr=0.05, steps=4, batch_size=8, lr_decay=0.95)
    module = tiny_module(ScaffoldP(eta_u=0.8, warm_start=warm_start), local)
    reference_model = copy.deepcopy(module.model)
    tiny_trainer(tmp_path, rounds=4).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
    x, c, c_i = reference_scaffold(reference_model, tiny_datamodule(num_clients=6, clients_per_round=3), local, 4, 0.8, warm_start)
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(p.detach(), x[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(module.server_state["c"][name], c[name], rtol=1e-5, atol=1e-6)
    for cid in module.store.client_ids():
        for name in x:
            torch.testing.assert_close(module.store.get(cid, None)["c"][name], c_i[cid][name], rtol=1e-5, atol=1e-6)


# docs/algorithms.md, E6
def test_scaffoldp_without_personal_tensors_is_the_scaffold_algorithm(tmp_path):
    """Against the framework's SCAFFOLD (issue 4) once it is merged; the reference above covers it until then."""
    import fl_lightning.algorithms as algorithms

    if not hasattr(algorithms, "SCAFFOLD"):
        pytest.skip("fl_lightning.algorithms.SCAFFOLD not merged yet")
    local = LocalTraining(lr=0.05, steps=4, batch_size=8, lr_decay=0.95)
    runs = {}
    for name, algorithm in {"scaffold": algorithms.SCAFFOLD(global_lr=0.8), "scaffoldp": ScaffoldP(eta_u=0.8, warm_start=False)}.items():
        runs[name] = tiny_module(algorithm, local)
        tiny_trainer(tmp_path / name, rounds=4).fit(runs[name], datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
    for a, b in zip(runs["scaffold"].model.parameters(), runs["scaffoldp"].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for name, c in runs["scaffold"].server_state["c"].items():
        torch.testing.assert_close(runs["scaffoldp"].server_state["c"][name], c, rtol=1e-6, atol=1e-7)
    assert runs["scaffold"].comm_totals == runs["scaffoldp"].comm_totals


# docs/algorithms.md, E6
def test_scaffoldp_server_control_variate_is_the_mean_of_all_client_variates(tmp_path):
    """c = (1/n) sum_i c_i over all n clients, after the warm start and every round (clients never seen hold 0)."""
    module = split_module(ScaffoldP(), LocalTraining(lr=0.05, steps=3, batch_size=8))
    data = binary_data(num_clients=5, clients_per_round=2)
    tiny_trainer(tmp_path, rounds=5).fit(module, datamodule=data)
    assert len(module.store) == 5  # the warm start gave every client its c_i
    for name, c in module.server_state["c"].items():
        mean = sum(module.store.get(i, None)["c"][name] for i in range(5)) / 5
        torch.testing.assert_close(c, mean, rtol=1e-5, atol=1e-7)
    assert set(module.server_state["c"]) == {"u"}  # control variates on the shared part only


# ---- the FedAvg-P rule itself ------------------------------------------------------------------------


def _full_grads(model, params, data, cid):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss, _, _ = Objective(model, ["u", "v"]).at(leaves, data.client_full_batch(cid))
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize("eta_u,eta_v", [(1.0, 1.0), (0.5, 0.25)])
def test_fedavgp_one_full_batch_step_uses_gamma_u_gamma_v_eta_u_eta_v(tmp_path, eta_u, eta_v):
    """K = 1, all clients, full batch: u+ = u - eta_u gamma_u mean_i grad_u f_i,  v_i+ = v - eta_v gamma_v grad_v f_i."""
    gamma_u, gamma_v = 0.3, 0.05
    module = split_module(FedAvgP(eta_u=eta_u, eta_v=eta_v), LocalTraining(lr=gamma_u, personal_lr=gamma_v, steps=1, batch_size=None))
    start = params_of(module)
    data = binary_data(num_clients=4, clients_per_round=4, partition=IID())
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=data)
    grads = [_full_grads(module.model, start, data, cid) for cid in range(4)]
    expected_u = start["u"] - eta_u * gamma_u * sum(g["u"] for g in grads) / 4
    torch.testing.assert_close(module.model.u.detach(), expected_u, rtol=1e-5, atol=1e-6)
    for cid, g in enumerate(grads):
        torch.testing.assert_close(personal_store(module).get(cid, None)["v"]["v"], start["v"] - eta_v * gamma_v * g["v"])
    assert torch.equal(module.model.v.detach(), start["v"])  # the model keeps the initial v as the template


class RecordingFedAlt(FedAlt):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps = []

    def client_step(self, params, local, ctx):
        new, local = super().client_step(params, local, ctx)
        self.steps.append((ctx.step, params, new))
        return new, local


def test_fedalt_personal_phase_leaves_shared_tensors_unchanged(tmp_path):
    algorithm = RecordingFedAlt(personal_steps=2)
    module = split_module(algorithm, LocalTraining(lr=0.1, steps=4, batch_size=8))
    tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=binary_data())
    assert len(algorithm.steps) == 2 * 3 * 4
    for step, before, after in algorithm.steps:
        frozen, moving = ("u", "v") if step < 2 else ("v", "u")
        assert torch.equal(before[frozen], after[frozen]), (step, frozen)
        assert not torch.equal(before[moving], after[moving]), (step, moving)


def test_fedalt_with_only_a_personal_phase_keeps_the_global_model(tmp_path):
    module = split_module(FedAlt(personal_steps=3), LocalTraining(lr=0.1, steps=3, batch_size=8))
    start = params_of(module)
    tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=binary_data())
    assert torch.equal(module.model.u.detach(), start["u"])
    assert all(not torch.equal(personal_store(module).get(c, None)["v"]["v"], start["v"]) for c in personal_store(module).client_ids())


# ---- personal tensors never leave the client; checkpoint and resume ---------------------------------------


@pytest.mark.parametrize("algorithm", [FedAvgP(eta_v=0.5), ScaffoldP(), FedAlt()], ids=["FedAvgP", "ScaffoldP", "FedAlt"])
def test_personal_tensors_never_appear_in_uploads(tmp_path, algorithm):
    module = split_module(algorithm)
    seen = []
    aggregate = algorithm.aggregate

    def recording_aggregate(x, uploads, weights, server_state, info, local_steps):
        seen.extend(uploads)
        return aggregate(x, uploads, weights, server_state, info, local_steps)

    algorithm.aggregate = recording_aggregate
    tiny_trainer(tmp_path, rounds=3).fit(module, datamodule=binary_data())
    assert module.federated_names == ["u"] and module.personal_names == ["v"]
    assert len(seen) == 9
    for upload in seen:
        for tensors in upload.values():
            assert set(tensors) == {"u"}
    per_upload = sum(4 * 5 for _ in seen[0])  # float32 u (5 entries) per payload entry
    assert module.comm_totals["bytes_up"] == 9 * per_upload + (5 * 4 * 5 if isinstance(algorithm, ScaffoldP) else 0)


def _fit_with_checkpoints(tmp_path, rounds, ckpt_path=None):
    module = split_module(ScaffoldP(eta_u=0.9, eta_v=0.7), LocalTraining(lr=0.05, personal_lr=0.1, steps=3, batch_size=8, lr_decay=0.9))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=binary_data(num_clients=6, clients_per_round=2), ckpt_path=ckpt_path)
    return module


def test_personal_tensors_stay_out_of_the_shared_checkpoint_and_survive_resume(tmp_path):
    straight = _fit_with_checkpoints(tmp_path / "a", rounds=6)
    first = _fit_with_checkpoints(tmp_path / "b", rounds=3)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    # The model's state holds the shared u and only the *initial* v (the template for clients not yet seen).
    initial_v = split_module(ScaffoldP()).model.v.detach()
    assert torch.equal(ckpt["state_dict"]["model.v"], initial_v)
    personal = {k: v for k, v in ckpt["federated"]["client_store"].items() if f"/{PERSONAL}/" in k}
    assert personal and all(key.endswith(f"/{PERSONAL}/v") for key in personal)
    assert all(not torch.equal(t, initial_v) for t in personal.values())
    assert personal_store(first).equal(_store_from(personal))

    resumed = _fit_with_checkpoints(tmp_path / "c", rounds=6, ckpt_path=str(last))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert personal_store(straight).equal(personal_store(resumed)) and len(personal_store(straight)) > len(personal_store(first))
    assert straight.store.equal(resumed.store)
    assert torch.equal(straight.server_state["c"]["u"], resumed.server_state["c"]["u"])
    assert straight.comm_totals == resumed.comm_totals


def _store_from(flat):
    """The clients' personal tensors of a flat checkpoint store, as ``{client: {"v": v_i}}``."""
    store = ClientStore()
    store.load_state_dict(flat)
    return _personal_only(store)


def personal_store(module):
    """The clients' personal tensors held in the module's client store, as ``{client: {"v": v_i}}``."""
    return _personal_only(module.store)


def _personal_only(store):
    personal = ClientStore()
    for cid in store.client_ids():
        state = store.get(cid, dict)
        if PERSONAL in state:
            personal.put(cid, {"v": state[PERSONAL]})
    return personal


# ---- metrics ------------------------------------------------------------------------------------------


def test_gradient_norm_is_the_gradient_of_the_global_objective(tmp_path):
    module = split_module(FedAvgP(), LocalTraining(lr=0.1, steps=2, batch_size=8, weight_decay=0.01))
    data = binary_data(num_clients=4, clients_per_round=2)
    tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=data)
    assert 0 < len(personal_store(module)) < 4  # a mix of trained and initial v_i

    n, model = 4, module.model
    u = module.model.u.detach().clone().requires_grad_(True)
    vs = [module.client_personal(i)["v"].clone().requires_grad_(True) for i in range(n)]
    total = 0
    for i in range(n):
        loss, _, _ = Objective(model, ["u", "v"]).at({"u": u, "v": vs[i]}, data.client_full_batch(i))
        total = total + (loss + 0.005 * ((u * u).sum() + (vs[i] * vs[i]).sum())) / n
    g_u, *g_vs = torch.autograd.grad(total, [u, *vs])
    expected_u = float((g_u.double() ** 2).sum())
    expected_v = sum(float(((n * g).double() ** 2).sum()) for g in g_vs) / n  # grad_{v_i} f = grad f_i / n
    got = GradientNorm().gradient_norms(module)
    assert got["grad_norm_u_sq"] == pytest.approx(expected_u, rel=1e-5)
    assert got["grad_norm_v_sq"] == pytest.approx(expected_v, rel=1e-5)
    assert got["grad_norm"] == pytest.approx((expected_u + expected_v) ** 0.5, rel=1e-5)


def test_personalized_evaluation_scores_each_client_on_the_validation_half_of_its_holdout(tmp_path):
    module = split_module(FedSim(), LocalTraining(lr=0.2, steps=3, batch_size=8))
    data = binary_data(num_clients=5, clients_per_round=3, holdout_fraction=0.3)
    callback = PersonalizedEvaluation()
    trainer = tiny_trainer(tmp_path, rounds=4, limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None,
                           callbacks=[callback, GradientNorm()])
    trainer.fit(module, datamodule=data)
    accs = []
    for cid in range(5):
        inputs, target = data.client_holdout_batch(cid, "validation")  # val/: the validation half
        out = functional_call(module.model, {"u": module.model.u, **module.client_personal(cid)}, (inputs,))
        accs.append((out.logits.argmax(-1) == target).double().mean())
    accs = torch.stack(accs)
    metrics = trainer.callback_metrics
    assert float(metrics["val/personal_acc_mean"]) == pytest.approx(float(accs.mean()), abs=1e-6)
    assert float(metrics["val/personal_acc_worst10"]) == pytest.approx(float(accs.min()), abs=1e-6)  # ceil(0.1 * 5) = 1
    assert "val/acc" in metrics and "algo/grad_norm" in metrics
    assert worst_fraction_mean(torch.tensor([0.9, 0.1, 0.5, 0.3] * 5), 0.1) == pytest.approx(0.1)


def test_personalized_evaluation_needs_a_holdout(tmp_path):
    trainer = tiny_trainer(tmp_path, rounds=1, callbacks=[PersonalizedEvaluation()])
    with pytest.raises(ValueError, match="holdout_fraction"):
        trainer.fit(split_module(FedSim()), datamodule=binary_data())


# ---- convergence: Scaffold-P removes client drift, FedAvg-P does not ---------------------------------------


# docs/algorithms.md, E14
def test_scaffoldp_reaches_a_stationary_point_where_fedavgp_stays_biased(tmp_path):
    """Full participation, full-batch local steps (no noise), K = 5: Scaffold-P's fixed point is stationary."""
    norms = {}
    for name, algorithm in {"FedAvgP": FedAvgP(), "ScaffoldP": ScaffoldP()}.items():
        module = split_module(algorithm, LocalTraining(lr=1.0, steps=5, batch_size=None))
        data = binary_data(num_clients=4, clients_per_round=4, partition=Dirichlet(0.2, min_size=8))
        tiny_trainer(tmp_path / name, rounds=40).fit(module, datamodule=data)
        norms[name] = GradientNorm().gradient_norms(module)["grad_norm_sq"]
    # measured: FedAvgP ~7e-5 (its fixed point carries the client drift); ScaffoldP falls ~10x per 4 rounds
    assert norms["ScaffoldP"] < 1e-8
    assert norms["FedAvgP"] > 1e-6


# ---- settings ---------------------------------------------------------------------------------------------


def test_personal_patterns_accept_module_paths():
    model = MLP(in_features=4, num_classes=2, hidden=[3])
    assert P.personal_names(model, ["net.3"]) == ["net.3.weight", "net.3.bias"]
    assert P.federated_names(model, ["net.3"]) == ["net.1.weight", "net.1.bias"]
    assert P.personal_names(model, ["*.bias"]) == ["net.1.bias", "net.3.bias"]


def test_bad_personalization_settings_are_rejected():
    with pytest.raises(ValueError, match="does not train personal tensors"):
        FederatedModule(SplitLogistic(8, 4), FedAvg(), personal=["v"])
    with pytest.raises(ValueError, match="eta_v"):
        FedAvgP(eta_v=0.0)
    with pytest.raises(ValueError, match="eta_u"):
        ScaffoldP(eta_u=-1.0)
    with pytest.raises(ValueError, match="personal_steps"):
        FedAlt(personal_steps=-1)
    with pytest.raises(ValueError, match="personal_lr"):
        LocalTraining(personal_lr=0.0)
    with pytest.raises(ValueError, match="shared_features"):
        SplitLogistic(in_features=8, shared_features=8)


# ---- the paper's experiment config -------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ScaffoldP"])  # the config's FedAvgP shares every other code path
def test_personalization_config_runs_and_logs_the_gradient_norm(tmp_path, monkeypatch, algorithm):
    import csv
    import sys
    from pathlib import Path

    from fl_lightning.commands.cli import build_cli

    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    config = Path(__file__).resolve().parents[1] / "configs" / "personalization_logistic.yaml"
    cli = build_cli(
        ["--config", str(config), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--model.local.steps", "3", "--model.algorithm", f"fl_lightning.algorithms.{algorithm}",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path)],
        run=False,
    )  # fmt: skip
    assert cli.model.personal_names == ["v"] and cli.model.federated_names == ["u"]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [r for r in rows if r["algo/grad_norm"]]
    assert len(evals) == 1 and float(evals[0]["algo/grad_norm"]) > 0
    assert 0 < float(evals[0]["val/personal_acc_mean"]) <= 1
    assert 9 <= len(personal_store(cli.model)) <= 10  # 2 rounds of m = 9 of n = 10 clients trained their v_i


def test_checkpoints_with_a_separate_personal_store_still_load(tmp_path):
    """Before personal tensors became client state, checkpoints kept them in ``federated.personal_store``."""
    module = _fit_with_checkpoints(tmp_path, rounds=3)
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    flat = ckpt["federated"]["client_store"]
    legacy = {k: v for k, v in flat.items() if f"/{PERSONAL}/" not in k}
    legacy_personal = {k.replace(f"/{PERSONAL}/", "/v/"): v for k, v in flat.items() if f"/{PERSONAL}/" in k}
    assert legacy_personal and len(legacy) < len(flat)
    fresh = split_module(ScaffoldP())
    fresh.on_load_checkpoint({"federated": {**ckpt["federated"], "client_store": legacy, "personal_store": legacy_personal}})
    assert fresh.store.equal(module.store)

"""Shared pieces of the personalized-FL method tests (tests/test_pfl_*.py): a tiny digits problem with
held-out and unseen clients, a fit helper, and an independent plain-PyTorch reference of training with
personal tensors (simultaneous SGD as FedSim, or the head first as FedRep), written without the
framework's algorithm code: only the data module's minibatches and round plans are shared."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

from datamodules import Dirichlet, FederatedDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from models import SmallCNN
from tests.conftest import tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
LR, STEPS, BATCH, ROUNDS = 0.1, 4, 16, 3


def data(**kw) -> FederatedDataModule:
    """Digits over 6 clients, Dirichlet(0.3) label skew, 20% held out; one client (of 6) never trains."""
    kw = {"holdout_fraction": 0.2, "new_client_fraction": 0.2, **kw}
    return FederatedDataModule("digits", num_clients=6, partition=Dirichlet(0.3, min_size=20), participation=UniformSampling(3), **kw)


def cnn(**kw) -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN(channels=4, hidden=16, **kw)


def fit(algorithm, personal=(), execution="sequential", rounds=ROUNDS, model_fn=cnn, steps=STEPS, **trainer_kw) -> FederatedModule:
    module = FederatedModule(model_fn(), algorithm, LocalTraining(lr=LR, steps=steps, batch_size=BATCH), personal=list(personal),
                             execution=execution)  # fmt: skip
    tiny_trainer("/tmp/unused", rounds, **trainer_kw).fit(module, datamodule=data())
    return module


def max_difference(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a)


def shared_params(module) -> dict:
    return {k: v.detach().clone() for k, v in module.model.named_parameters() if k in module.federated_names}


def grads(model, params, inputs, target, loss=None):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    logits = functional_call(model, leaves, (inputs,))
    value = F.cross_entropy(logits, target) if loss is None else loss(logits, target)
    return dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))


def reference_partial(model, personal_names, rounds=ROUNDS, head_steps=None, lr=LR, steps=STEPS, head_first=True):
    """Partial personalization in plain PyTorch. Each round every sampled client starts from the global
    shared tensors x and its own personal tensors v_i (the model's initial values at first) and runs
    ``steps`` SGD steps on its round's minibatches: all tensors at once (``head_steps=None``: FedPer,
    LG-FedAvg, FedBN, i.e. FedSim), or the personal ones only for the first ``head_steps`` steps and the
    shared ones only after (FedRep; ``head_first=False``: the last ``head_steps`` steps instead). It keeps v_{i,K}; the server sets x <- x + sum_i w_i (x_i - x).

    Returns (x, {client: v_i}, predict) with ``predict(client)`` = {x, v_i} and ``unseen(client, round)``:
    the prediction of a client that never trained after one such local round from the model's initial
    personal values, on the batches of its personalization seed (its trained shared tensors discarded).
    """
    d = data()
    d.setup()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = {n: v for n, v in init.items() if n not in personal_names}
    v = {}

    def local_round(cid, seed, x):
        p = {**x, **v.get(cid, {n: init[n] for n in personal_names})}
        for k, (inputs, target) in enumerate(d.client_batches(cid, seed, BATCH, steps)):
            g = grads(model, p, inputs, target)
            if head_steps is None:
                moving = set(p)
            else:
                head_phase = k < head_steps if head_first else k >= steps - head_steps
                moving = set(personal_names) if head_phase else set(x)
            p = {n: p[n] - lr * g[n] if n in moving else p[n] for n in p}
        return p

    for t in range(rounds):
        plan = d.participation.plan(t, d.client_sizes, d.seed)
        new_x = dict(x)
        for cid, seed, w in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            p = local_round(cid, seed, x)
            v[cid] = {n: p[n] for n in personal_names}
            new_x = {n: new_x[n] + w * (p[n] - x[n]) for n in x}
        x = new_x

    def predict(cid):
        return {**x, **v.get(cid, {n: init[n] for n in personal_names})}

    def unseen(cid, round_idx):
        p = local_round(cid, derive_seed(d.seed, cid, round_idx, PERSONALIZE_STREAM), x)
        return {**x, **{n: p[n] for n in personal_names}}

    return x, v, predict, unseen, d.unseen_clients


def fit_config(tmp_path, monkeypatch, name, *extra):
    """``fl-lightning fit --config configs/<name>.yaml`` for 3 rounds, evaluated at round 3; the metrics.csv rows."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", "1", *extra]  # fmt: skip
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), *args])
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        return cli, list(csv.DictReader(f))


def assert_personal_metrics(rows):
    """The personalized and unseen-client metrics of the protocol, in the rows of the evaluation."""
    evaluated = [r for r in rows if r.get("val/personal_acc_mean")]
    assert evaluated, "no evaluation row"
    for stage in ("val", "test"):
        for prefix in ("personal", "unseen"):
            for stat in ("mean", "weighted", "worst10"):
                values = [float(r[f"{stage}/{prefix}_acc_{stat}"]) for r in rows if r.get(f"{stage}/{prefix}_acc_{stat}")]
                assert values and all(0 <= v <= 1 for v in values), (stage, prefix, stat)


def compare_partial(algorithm, personal, head_steps=None, model_fn=cnn, execution="sequential") -> dict[str, float]:
    """Fit ``algorithm`` with ``personal`` patterns and the reference; the largest differences of the global
    shared tensors, every trained client's stored personal tensors, the parameters each training client
    predicts with (``prediction_params``) and those of the unseen client (``unseen_prediction_params``)."""
    module = fit(algorithm, personal, execution, model_fn=model_fn)
    x, v, predict, unseen, unseen_clients = reference_partial(model_fn(), module.personal_names, head_steps=head_steps)
    assert unseen_clients == module.datamodule.unseen_clients and len(unseen_clients) == 1
    trained = sorted(module.store.client_ids())
    assert trained == sorted(v) and len(trained) >= 3
    round_idx = module.global_step - 1
    return {
        "global": max_difference(shared_params(module), x),
        "personal": max(max_difference(module.client_personal(c), v[c]) for c in trained),
        "predict": max(max_difference(module.prediction_params(c), predict(c)) for c in range(module.datamodule.num_clients)),
        "unseen": max_difference(module.unseen_prediction_params(unseen_clients[0]), unseen(unseen_clients[0], round_idx)),
        "personal_moved": min(max_difference(v[c], {n: module.model.get_parameter(n) for n in v[c]}) for c in trained),
    }


def record_uploads(algorithm) -> list:
    """The uploads the server aggregates, recorded (the algorithm's aggregate wrapped)."""
    seen, aggregate = [], algorithm.aggregate

    def recording(x, uploads, weights, server_state, info, local_steps):
        seen.extend(uploads)
        return aggregate(x, uploads, weights, server_state, info, local_steps)

    algorithm.aggregate = recording
    return seen


def batched_equals_sequential(algorithm_fn, personal, model_fn=cnn) -> float:
    """Batched execution stacks the clients' personal tensors (no fallback) and equals sequential execution to
    float tolerance (shared model and every client's stored personal tensors); returns the largest difference."""
    bat = fit(algorithm_fn(), personal, "batched", model_fn=model_fn)
    assert not bat.executor.inner.fallbacks, bat.executor.inner.fallbacks
    seq = fit(algorithm_fn(), personal, "sequential", model_fn=model_fn)
    difference = max_difference(shared_params(bat), shared_params(seq))
    assert difference < 1e-5
    assert set(bat.store.client_ids()) == set(seq.store.client_ids())
    for cid in seq.store.client_ids():
        for k, v in seq.client_personal(cid).items():
            difference = max(difference, float((bat.client_personal(cid)[k] - v).abs().max()))
    assert difference < 1e-5
    return difference


def config_fits_through_the_cli(tmp_path, name: str, algorithm: str) -> list[dict]:
    """``fl-lightning fit --config configs/<name>.yaml`` as a user runs it (a subprocess), 3 rounds evaluated at
    round 3: the result line names the algorithm and metrics.csv holds the protocol's numbers; its rows."""
    from tests.test_cli import fl_lightning

    proc = fl_lightning("fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), "--trainer.max_steps", "3",
                        "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false", cwd=tmp_path)  # fmt: skip
    assert proc.stdout.startswith(f"{algorithm}: 3 rounds"), proc.stdout
    with open(tmp_path / "runs" / name / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert_personal_metrics(rows)
    return rows


def mlp_logits(p: dict, x):
    """``MLP(8, 3, hidden=[16])`` written out (the reference's own forward, not the model's)."""
    return torch.relu(x @ p["net.1.weight"].T + p["net.1.bias"]) @ p["net.3.weight"].T + p["net.3.bias"]


def mlp_grad(p: dict, x, y) -> dict:
    """The cross-entropy gradient of ``mlp_logits`` at ``p`` on (x, y), by plain autograd."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
    grads = torch.autograd.grad(F.cross_entropy(mlp_logits(leaves, x), y), list(leaves.values()))
    return dict(zip(leaves, grads))

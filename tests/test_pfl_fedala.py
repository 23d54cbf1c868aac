"""FedALA (docs/algorithms.md, section 25.11): against an independent plain-PyTorch FedALA, its reductions
to FedAvg, batched execution (declared fallback; stacked without weight learning), the model clients
predict with, unseen clients, the config through the CLI, resume, and its refusals."""

import csv
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import Shards
from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import FedALA
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
LR, STEPS, BATCH, ROUNDS, CLIENTS = 0.2, 3, 16, 3, 3


def _data(**kw):
    """Three clients, all training every round (weights 1/3), each holding one shard of the label-sorted
    samples, 30% held out; ``new_client_fraction`` adds unseen ones."""
    return tiny_datamodule(num_clients=CLIENTS, clients_per_round=CLIENTS, partition=Shards(1), holdout_fraction=0.3, **kw)


def _fit(algorithm, execution="sequential", rounds=ROUNDS, data=None, directory="/tmp/unused", **trainer_kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=BATCH), execution=execution)
    data = data if data is not None else _data()
    trainer = tiny_trainer(directory, rounds, **trainer_kw)
    trainer.fit(module, datamodule=data)
    return module, data, trainer


# ---- an independent FedALA: lists of tensors in parameter order, as PFLlib's ALA module -------------------
def _mlp(p, x):
    """MLP(8, 3, hidden=[16]) written out, parameters as a list [W1, b1, W2, b2]: logits."""
    return torch.relu(x @ p[0].T + p[1]) @ p[2].T + p[3]


def _grad(p, inputs, target):
    leaves = [v.clone().requires_grad_(True) for v in p]
    return torch.autograd.grad(F.cross_entropy(_mlp(leaves, inputs), target), leaves)


def _sgd(p, batches):
    for inputs, target in batches:
        p = [v - LR * g for v, g in zip(p, _grad(p, inputs, target))]
    return p


def _ala(local, global_, weights, inputs, target, eta, steps, layer_idx):
    """PFLlib's adaptive_local_aggregation with full-batch steps: lower layers from the global model, the
    top ones theta + (global - theta) * W, W <- clamp(W - eta * grad * (global - theta), 0, 1)."""
    lower = [g.clone() for g in global_[:-layer_idx]]
    top, top_g = local[-layer_idx:], global_[-layer_idx:]
    mixed = lambda w: lower + [t + (g - t) * wi for t, g, wi in zip(top, top_g, w)]  # noqa: E731
    for _ in range(steps):
        grads = _grad(mixed(weights), inputs, target)[-layer_idx:]
        weights = [torch.clamp(w - eta * gr * (g - t), 0, 1) for w, gr, g, t in zip(weights, grads, top_g, top)]
    return mixed(weights), weights


def reference_fedala(eta, steps, layer_idx, rounds=ROUNDS, data_fn=_data):
    torch.manual_seed(0)
    names = [k for k, _ in MLP(8, 3, hidden=[16]).named_parameters()]
    torch.manual_seed(0)
    x = [v.detach().clone() for v in MLP(8, 3, hidden=[16]).parameters()]
    data = data_fn()
    data.setup()
    models = [list(x) for _ in range(data.num_clients)]
    weights = [[torch.ones_like(v) for v in x[-layer_idx:]] for _ in range(data.num_clients)]
    for round_idx in range(rounds):
        for cid in range(data.num_clients):
            start, weights[cid] = _ala(models[cid], x, weights[cid], *data.client_full_batch(cid), eta, steps, layer_idx)
            models[cid] = _sgd(start, data.client_batches(cid, derive_seed(data.seed, round_idx, cid), BATCH, STEPS))
        x = [xv + sum(m[j] - xv for m in models) / len(models) for j, xv in enumerate(x)]
    as_dict = lambda p: dict(zip(names, p))  # noqa: E731
    return as_dict(x), [as_dict(m) for m in models], [dict(zip(names[-layer_idx:], w)) for w in weights], data


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _global(module):
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}


@pytest.mark.parametrize("layer_idx", [2, 3])
def test_fedala_equals_an_independent_reference(layer_idx):
    x, models, weights, _ = reference_fedala(eta=1.0, steps=5, layer_idx=layer_idx)
    module, _, _ = _fit(FedALA(layer_idx=layer_idx, eta=1.0, ala_steps=5))
    diffs = [_max_diff(_global(module), x)]
    for cid in range(CLIENTS):
        state = module.store.get(cid, dict)
        diffs += [_max_diff(state["model"], models[cid]), _max_diff(state["weights"], weights[cid])]
        diffs.append(_max_diff(module.prediction_params(cid), models[cid]))
        assert list(state["weights"]) == list(x)[-layer_idx:]
    print(f"FedALA (layer_idx {layer_idx}) vs reference: max difference {max(diffs):.2e}")
    assert max(diffs) < 1e-6
    learned = torch.cat([w.reshape(-1) for cid in range(CLIENTS) for w in weights[cid].values()])
    assert (learned < 1).any() and (learned > 0).any()  # the weights were learned, not stuck at 1 (nor all clipped to 0)


def test_the_first_round_is_fedavg_bitwise():
    """At a client's first round theta_i = x: the aggregate is x whatever W, and W does not move."""
    ala, _, _ = _fit(FedALA(ala_steps=5), rounds=1)
    fedavg, _, _ = _fit(FedAvg(), rounds=1)
    for a, b in zip(ala.model.parameters(), fedavg.model.parameters()):
        assert torch.equal(a, b)
    for cid in range(CLIENTS):
        assert all(torch.equal(w, torch.ones_like(w)) for w in ala.store.get(cid, dict)["weights"].values())


def test_without_weight_learning_it_is_fedavg():
    """ala_steps = 0 keeps W_i = 1, so theta_hat = theta_i + (x - theta_i) = x: FedAvg (float rounding of that sum)."""
    ala, _, _ = _fit(FedALA(ala_steps=0))
    fedavg, _, _ = _fit(FedAvg())
    difference = _max_diff(_global(ala), _global(fedavg))
    print(f"FedALA ala_steps=0 vs FedAvg: max difference {difference:.2e}")
    assert difference < 1e-6


def test_batched_execution_stacks_the_weight_learning_over_the_clients_whole_sets(caplog):
    """(25.11.2)'s full gradients stacked (each client's whole set padded, its padded rows masked): every round
    stacked, sequential execution's models and stored (theta_i, W_i) to float tolerance."""
    with caplog.at_level(logging.INFO, logger="fl_lightning.executors.batched"):
        batched, _, _ = _fit(FedALA(ala_steps=5), "batched")
    assert "runs FedALA's rounds again" in caplog.text and not batched.executor.inner.fallbacks
    assert batched.executor.inner.stats["stacked_rounds"] == ROUNDS
    sequential, _, _ = _fit(FedALA(ala_steps=5))
    difference = max(_max_diff(_global(batched), _global(sequential)),
                     *(_max_diff(batched.store.get(c, dict)[key], sequential.store.get(c, dict)[key]) for c in range(CLIENTS) for key in ("model", "weights")))  # fmt: skip
    print(f"FedALA batched (stacked, ala_steps=5) vs sequential: max difference {difference:.2e}")
    assert difference < 1e-5


def test_without_weight_learning_the_rule_runs_stacked_like_sequential():
    """ala_steps = 0 reads no full gradient: the rule (a model carried in local state) runs under vmap."""
    batched, _, _ = _fit(FedALA(ala_steps=0), "batched")
    assert not batched.executor.inner.fallbacks
    sequential, _, _ = _fit(FedALA(ala_steps=0))
    difference = max(_max_diff(_global(batched), _global(sequential)),
                     *(_max_diff(batched.store.get(c, dict)["model"], sequential.store.get(c, dict)["model"]) for c in range(CLIENTS)))  # fmt: skip
    print(f"FedALA batched (stacked, ala_steps=0) vs sequential: max difference {difference:.2e}")
    assert difference < 1e-6


def test_clients_are_scored_with_their_own_model_not_the_global_one(tmp_path):
    _, models, _, data = reference_fedala(eta=1.0, steps=5, layer_idx=2)
    module, data, trainer = _fit(FedALA(), directory=tmp_path, limit_val_batches=None, val_check_interval=ROUNDS,
                                 check_val_every_n_epoch=None)  # fmt: skip
    x = list(_global(module).values())
    own, glob = [], []
    for cid in range(CLIENTS):
        inputs, target = data.client_holdout_batch(cid, "validation")
        own.append(float((_mlp(list(models[cid].values()), inputs).argmax(-1) == target).double().mean()))
        glob.append(float((_mlp(x, inputs).argmax(-1) == target).double().mean()))
    assert float(trainer.callback_metrics["val/personal_acc_mean"]) == pytest.approx(sum(own) / CLIENTS, abs=1e-6)
    assert abs(sum(own) - sum(glob)) / CLIENTS > 0.05


def test_an_unseen_client_trains_one_round_from_the_global_model(tmp_path):
    data = _data(new_client_fraction=0.25)
    module, data, trainer = _fit(FedALA(), data=data, directory=tmp_path, limit_val_batches=None, val_check_interval=ROUNDS,
                                 check_val_every_n_epoch=None)  # fmt: skip
    (cid,) = data.unseen_clients
    x = _global(module)
    seed = derive_seed(data.seed, cid, ROUNDS - 1, PERSONALIZE_STREAM)
    expected = dict(zip(x, _sgd(list(x.values()), data.client_batches(cid, seed, BATCH, STEPS))))
    got = module.unseen_prediction_params(cid)
    assert _max_diff(got, expected) < 1e-6 and _max_diff(got, x) > 1e-3
    inputs, target = data.client_holdout_batch(cid, "validation")
    accuracy = float((_mlp(list(expected.values()), inputs).argmax(-1) == target).double().mean())
    assert float(trainer.callback_metrics["val/unseen_acc_mean"]) == pytest.approx(accuracy, abs=1e-6)


def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
            "--model.local.steps", "2"]  # fmt: skip
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / "pfl_fedala_digits.yaml"), *args])
    algorithm = cli.model.algorithm
    assert type(algorithm) is FedALA and (algorithm.layer_idx, algorithm.eta, algorithm.ala_steps) == (2, 1.0, 5)
    assert cli.trainer.global_step == 3
    with open(tmp_path / "runs" / "pfl_fedala_digits" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [r for r in rows if r.get("val/personal_acc_mean")]
    assert evaluated, "no personalized evaluation row"
    for name in ("val/personal_acc_mean", "val/personal_acc_weighted", "val/personal_acc_worst10", "val/unseen_acc_mean"):
        assert 0.0 <= float(evaluated[-1][name]) <= 1.0, name
    assert set(cli.model.store.get(next(iter(cli.model.store.client_ids())), dict)["weights"]) == {"classifier.2.weight", "classifier.2.bias"}


def _fit_checkpointed(directory, rounds, ckpt_path=None):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedALA(), LocalTraining(lr=LR, steps=STEPS, batch_size=8))
    checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=4, clients_per_round=2), ckpt_path=ckpt_path)
    return module


def test_resume_continues_bitwise(tmp_path):
    """The clients' models and aggregation weights are client state: checkpointed, and a resumed run continues bit for bit."""
    straight = _fit_checkpointed(tmp_path / "a", 4)
    _fit_checkpointed(tmp_path / "b", 2)
    resumed = _fit_checkpointed(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert _max_diff(_global(straight), _global(resumed)) == 0.0
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)
    weights = [w for c in straight.store.client_ids() for w in straight.store.get(c, dict)["weights"].values()]
    assert any((w < 1).any() for w in weights)  # learned weights went through the checkpoint


def test_bad_settings_are_refused_in_one_line():
    for bad, match in [(dict(layer_idx=0), r"FedALA layer_idx must be an integer >= 1, got 0"),
                       (dict(eta=0.0), r"FedALA eta must be > 0, got 0.0"),
                       (dict(ala_steps=-1), r"FedALA ala_steps must be an integer >= 0, got -1")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            FedALA(**bad)

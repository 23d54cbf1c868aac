"""Ditto (docs/algorithms.md, section 25.3): the rule against an independent plain-PyTorch Ditto, its
reductions (the global model is FedAvg's bit for bit; lambda = 0 makes v_i the local model), batched
execution, the personal model at evaluation (training and unseen clients), the config through the CLI,
and resume of the personal models."""

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import Ditto
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from fl_lightning.engine.personal_eval import PersonalizedEvaluation
from fl_lightning.experiments.testing import check_batched
from models import MLP
from tests.pfl_reference import config_fits_through_the_cli, mlp_grad, mlp_logits as _mlp
from tests.conftest import tiny_datamodule, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
LAM, GLOBAL_LR, ROUNDS = 0.5, 0.9, 4
LOCAL = LocalTraining(lr=0.1, personal_lr=0.05, steps=3, batch_size=8, lr_decay=0.9)
UNSEEN = 6  # of 7 clients, new_client_fraction 0.2: clients 0-5 train (3 and 4 are never selected in 4 rounds), 6 never does


def _data():
    """7 clients (6 training, 1 unseen), 2 per round (clients join at different rounds, some twice), 25% held out."""
    return tiny_datamodule(num_clients=7, clients_per_round=2, holdout_fraction=0.25, new_client_fraction=0.2)


def _fit(algorithm, execution="sequential", rounds=ROUNDS, local=LOCAL, directory="/tmp/unused", ckpt_path=None, **trainer_kw):
    """A fitted module and the uploads of every round (``[round][client in plan order]``, the deltas)."""
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm, local, execution=execution)
    uploads, aggregate = [], algorithm.aggregate

    def recording(x, ups, *args):
        uploads.append([{k: v.detach().clone() for k, v in u["delta"].items()} for u in ups])
        return aggregate(x, ups, *args)

    algorithm.aggregate = recording
    tiny_trainer(directory, rounds, **trainer_kw).fit(module, datamodule=_data(), ckpt_path=ckpt_path)
    return module, uploads


# ---- an independent Ditto: plain tensors, a written-out MLP, autograd ---------------------------------
def _grad(p, batch):
    return mlp_grad(p, *batch)


def _ditto_client(x, v, batches, lam, lr, personal_lr):
    """Ditto Alg. 1 on one client: K steps of local SGD on w (from x) and of v <- v - lr_v (grad + lam (v - x))."""
    w = dict(x)
    for batch in batches:
        g, g_v = _grad(w, batch), _grad(v, batch)
        w = {k: w[k] - lr * g[k] for k in x}
        v = {k: v[k] - personal_lr * (g_v[k] + lam * (v[k] - x[k])) for k in x}
    return w, v


def ditto_reference(lam=LAM, global_lr=GLOBAL_LR, rounds=ROUNDS, local=LOCAL):
    """The global model, each trained client's v_i, every round's uploads, and the unseen client's v after its
    one evaluation round (from v = x); v_i starts at the broadcast of the client's first round."""
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = _data()
    data.setup()
    personal_lr = local.lr if local.personal_lr is None else local.personal_lr
    v, uploads = {}, []
    for t in range(rounds):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        lr, lr_v = local.lr * local.lr_decay**t, personal_lr * local.lr_decay**t
        deltas = []
        for cid, seed in zip(plan.clients.tolist(), plan.seeds.tolist()):
            w, v[cid] = _ditto_client(x, v.get(cid, x), data.client_batches(cid, seed, local.batch_size, local.steps), lam, lr, lr_v)
            deltas.append({k: w[k] - x[k] for k in x})
        uploads.append(deltas)
        x = {k: x[k] + global_lr * sum(p * d[k] for p, d in zip(plan.weights.tolist(), deltas)) for k in x}
    last = rounds - 1
    batches = data.client_batches(UNSEEN, derive_seed(data.seed, UNSEEN, last, PERSONALIZE_STREAM), local.batch_size, local.steps)
    _, unseen = _ditto_client(x, x, batches, lam, local.lr * local.lr_decay**last, personal_lr * local.lr_decay**last)
    return x, v, uploads, unseen, data


def _difference(a, b):
    return max(float((a[k].detach() - b[k]).abs().max()) for k in b)


@pytest.fixture(scope="module")
def reference():
    return ditto_reference()


@functools.cache
def _fitted(name, execution):
    if name == "Ditto":
        return _fit(Ditto(lam=LAM, global_lr=GLOBAL_LR), execution)
    return _fit(FedAvg(global_lr=GLOBAL_LR), execution, local=dataclasses.replace(LOCAL, personal_lr=None))  # FedAvg has no gamma_v


@pytest.fixture(params=["sequential", "batched"])
def fitted(request):
    return request.param, *_fitted("Ditto", request.param)


# ---- (a) the rule against the reference ----------------------------------------------------------------
def test_ditto_equals_an_independent_reference(fitted, reference):
    execution, module, uploads = fitted
    x, v, ref_uploads, unseen, data = reference
    if execution == "batched":
        assert not module.executor.inner.fallbacks  # every round ran stacked
    assert sorted(v) == sorted(module.store.client_ids()) and len(v) < data.num_clients  # a client never selected too
    differences = {"global": _difference(dict(module.model.named_parameters()), x)}
    differences["uploads"] = max(_difference(u, r) for got, ref in zip(uploads, ref_uploads, strict=True) for u, r in zip(got, ref, strict=True))
    differences["v_i (state)"] = max(_difference(module.store.get(cid, None)["v"], v[cid]) for cid in v)
    differences["prediction"] = max(_difference(module.prediction_params(cid), v.get(cid, x)) for cid in range(data.num_clients))
    differences["unseen"] = _difference(module.unseen_prediction_params(UNSEEN), unseen)
    print(f"Ditto {execution}: max |difference| to the reference", {k: f"{d:.1e}" for k, d in differences.items()})
    assert max(differences.values()) < 1e-6
    assert _difference(v[0], x) > 1e-2  # the personal models are not the global one


# ---- (b) reductions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_the_global_model_and_uploads_are_fedavgs_bitwise(execution):
    (ditto, ditto_uploads), (fedavg, fedavg_uploads) = _fitted("Ditto", execution), _fitted("FedAvg", execution)
    for (name, a), b in zip(ditto.model.named_parameters(), fedavg.model.parameters()):
        assert torch.equal(a, b), name
    for got, ref in zip(ditto_uploads, fedavg_uploads, strict=True):
        for u, r in zip(got, ref, strict=True):
            assert all(torch.equal(u[k], r[k]) for k in r)
    assert ditto.comm_totals == fedavg.comm_totals  # the same messages: v_i never leaves the client


class RecordingDitto(Ditto):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.finished = []  # (first round of the client, its local model w_{i,K}, its v_{i,K})

    def client_finish(self, params, local, ctx):
        first = all(torch.equal(ctx.client_state["v"][k], ctx.broadcast["x"][k]) for k in params)
        self.finished.append((first, params, local["v"]))
        return super().client_finish(params, local, ctx)


def test_lambda_zero_makes_v_the_local_model():
    """lam = 0, gamma_v = eta_l: in a client's first round v_i is FedAvg's local model bit for bit; afterwards it
    keeps training locally from its own v_i (the reference), no longer the local model started from the broadcast."""
    local = LocalTraining(lr=0.1, steps=3, batch_size=8, lr_decay=0.9)
    algorithm = RecordingDitto(lam=0.0)
    module, _ = _fit(algorithm, local=local)
    firsts = [(w, v) for first, w, v in algorithm.finished if first]
    later = [(w, v) for first, w, v in algorithm.finished if not first]
    assert firsts and later  # clients selected for the first time, and again
    for w, v in firsts:
        assert all(torch.equal(w[k], v[k]) for k in w)
    for w, v in later:
        assert _difference(w, v) > 1e-3
    _, v_ref, _, _, _ = ditto_reference(lam=0.0, global_lr=1.0, local=local)
    assert max(_difference(module.store.get(cid, None)["v"], v_ref[cid]) for cid in v_ref) < 1e-6


# ---- (c) batched execution ---------------------------------------------------------------------------
def test_batched_execution_equals_sequential():
    result = check_batched(Ditto(lam=LAM), local=LOCAL, rounds=3)
    print(f"Ditto batched vs sequential: {result.max_difference:.1e} at {result.where}")
    assert result.stacked_rule == "elementwise" and result.max_difference < 1e-6


# ---- (d) evaluation uses v_i ---------------------------------------------------------------------------
def assert_evaluation_scores_the_personal_models(module, x, personal, unseen, data):
    """The logged personal and unseen losses are those of the reference's own models (``personal[cid]``, else x),
    and differ from the global model's: evaluating x instead would fail."""

    def mean_loss(clients, params_of):
        losses = []
        for cid in clients:
            inputs, target = data.client_holdout_batch(cid)
            losses.append(float(F.cross_entropy(_mlp(params_of(cid), inputs), target)))
        return sum(losses) / len(losses)

    metrics = PersonalizedEvaluation().evaluate(module)
    training = range(data.num_clients)
    assert metrics["personal_loss_mean"] == pytest.approx(mean_loss(training, lambda c: personal.get(c, x)), abs=1e-5)
    assert metrics["unseen_loss_mean"] == pytest.approx(mean_loss([UNSEEN], lambda c: unseen), abs=1e-5)
    assert abs(metrics["personal_loss_mean"] - mean_loss(training, lambda c: x)) > 1e-3  # the global model scores otherwise
    assert abs(metrics["unseen_loss_mean"] - mean_loss([UNSEEN], lambda c: x)) > 1e-3


def test_personalized_evaluation_scores_the_personal_models(fitted, reference):
    x, v, _, unseen, data = reference
    assert_evaluation_scores_the_personal_models(fitted[1], x, v, unseen, data)


# ---- (e) the config through the CLI --------------------------------------------------------------------
def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path):
    config_fits_through_the_cli(tmp_path, "pfl_ditto_digits", "Ditto")


# ---- (f) resume ----------------------------------------------------------------------------------------
def assert_resume_is_bitwise(tmp_path, make, **fit_kw):
    """4 rounds straight equal 2 rounds, then 2 more resumed from the checkpoint: the global model and every
    client's stored state (its personal model) bit for bit."""

    def run(directory, rounds, ckpt_path=None):
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        module, _ = _fit(make(), rounds=rounds, directory=directory, enable_checkpointing=True, callbacks=[checkpoint],
                         ckpt_path=ckpt_path, **fit_kw)  # fmt: skip
        return module

    straight = run(tmp_path / "a", 4)
    first = run(tmp_path / "b", 2)
    resumed = run(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert len(straight.store) > len(first.store) > 0 and straight.store.equal(resumed.store)
    assert not first.store.equal(straight.store)


def test_resume_continues_the_personal_models_bitwise(tmp_path):
    assert_resume_is_bitwise(tmp_path, lambda: Ditto(lam=LAM))


def test_bad_lambda_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^Ditto lam must be >= 0, got -1$"):
        Ditto(lam=-1)

"""pFedMe (docs/algorithms.md, section 25.4): the rule against an independent plain-PyTorch pFedMe, its exact
reductions (no inner steps: nothing moves; lambda = 0: theta is FedAvg's local model and w stays), the server
step beta = global_lr, batched execution, the personal model at evaluation (training and unseen clients), the
config through the CLI, and resume of the personal models."""

import functools

import pytest
import torch

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.algorithms import PFedMe
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from fl_lightning.experiments.testing import check_batched
from models import MLP
from tests.pfl_reference import config_fits_through_the_cli
from tests.test_pfl_ditto import (
    UNSEEN, _data, _difference, _fit, _grad, assert_evaluation_scores_the_personal_models, assert_resume_is_bitwise,
)

LAM, INNER, BETA, ROUNDS = 15.0, 3, 0.8, 4
LOCAL = LocalTraining(lr=0.05, personal_lr=0.03, steps=3, batch_size=8, lr_decay=0.9)  # lr lam = 0.75, personal_lr lam = 0.45


# ---- an independent pFedMe: plain tensors, a written-out MLP, autograd ---------------------------------
def _pfedme_client(x, batches, lam, inner_steps, lr, personal_lr):
    """pFedMe Alg. 1 on one client from w = theta = x: per minibatch, ``inner_steps`` gradient steps on
    f(theta; batch) + lam/2 ||theta - w||^2 from the previous theta, then w <- w - lr lam (w - theta)."""
    w, theta = dict(x), dict(x)
    for batch in batches:
        for _ in range(inner_steps):
            g = _grad(theta, batch)
            theta = {k: theta[k] - personal_lr * (g[k] + lam * (theta[k] - w[k])) for k in x}
        w = {k: w[k] - lr * lam * (w[k] - theta[k]) for k in x}
    return w, theta


def pfedme_reference(lam=LAM, inner_steps=INNER, beta=BETA, rounds=ROUNDS, local=LOCAL):
    """The global model, each trained client's last theta, every round's uploads w_i - x, and the unseen
    client's theta after its one evaluation round; server x <- (1 - beta) x + beta sum_i p_i w_i."""
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = _data()
    data.setup()
    personal_lr = local.lr if local.personal_lr is None else local.personal_lr
    thetas, uploads = {}, []
    for t in range(rounds):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        lr, lr_v = local.lr * local.lr_decay**t, personal_lr * local.lr_decay**t
        locals_ = []
        for cid, seed in zip(plan.clients.tolist(), plan.seeds.tolist()):
            w, thetas[cid] = _pfedme_client(x, data.client_batches(cid, seed, local.batch_size, local.steps), lam, inner_steps, lr, lr_v)
            locals_.append(w)
        uploads.append([{k: w[k] - x[k] for k in x} for w in locals_])
        x = {k: (1 - beta) * x[k] + beta * sum(p * w[k] for p, w in zip(plan.weights.tolist(), locals_)) for k in x}
    last = rounds - 1
    batches = data.client_batches(UNSEEN, derive_seed(data.seed, UNSEEN, last, PERSONALIZE_STREAM), local.batch_size, local.steps)
    _, unseen = _pfedme_client(x, batches, lam, inner_steps, local.lr * local.lr_decay**last, personal_lr * local.lr_decay**last)
    return x, thetas, uploads, unseen, data


@pytest.fixture(scope="module")
def reference():
    return pfedme_reference()


@functools.cache
def _fitted(execution):
    return _fit(PFedMe(lam=LAM, inner_steps=INNER, global_lr=BETA), execution, local=LOCAL)


@pytest.fixture(params=["sequential", "batched"])
def fitted(request):
    return request.param, *_fitted(request.param)


# ---- (a) the rule against the reference ----------------------------------------------------------------
def test_pfedme_equals_an_independent_reference(fitted, reference):
    execution, module, uploads = fitted
    x, thetas, ref_uploads, unseen, data = reference
    if execution == "batched":
        assert not module.executor.inner.fallbacks  # every round ran stacked
    assert sorted(thetas) == sorted(module.store.client_ids()) and len(thetas) < data.num_clients  # a client never selected too
    differences = {"global": _difference(dict(module.model.named_parameters()), x)}
    differences["uploads"] = max(_difference(u, r) for got, ref in zip(uploads, ref_uploads, strict=True) for u, r in zip(got, ref, strict=True))
    differences["theta_i (state)"] = max(_difference(module.store.get(cid, None)["theta"], thetas[cid]) for cid in thetas)
    differences["prediction"] = max(_difference(module.prediction_params(cid), thetas.get(cid, x)) for cid in range(data.num_clients))
    differences["unseen"] = _difference(module.unseen_prediction_params(UNSEEN), unseen)
    print(f"pFedMe {execution}: max |difference| to the reference", {k: f"{d:.1e}" for k, d in differences.items()})
    assert max(differences.values()) < 1e-6
    assert _difference(thetas[0], x) > 1e-2  # the personal models are not the global one


# ---- (b) exact reductions ------------------------------------------------------------------------------
class RecordingPFedMe(PFedMe):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.finished = []  # (broadcast x, w_{i,K}, theta)

    def client_finish(self, params, local, ctx):
        self.finished.append((ctx.broadcast["x"], params, local["theta"]))
        return super().client_finish(params, local, ctx)


class RecordingFedAvg(FedAvg):
    def __init__(self):
        super().__init__()
        self.finished = []  # x_{i,K}

    def client_finish(self, params, local, ctx):
        self.finished.append(params)
        return super().client_finish(params, local, ctx)


def _initial():
    torch.manual_seed(0)
    return {k: v.detach() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}


def test_without_inner_steps_nothing_moves():
    """K_in = 0: theta stays w_{i,0} = x, so w_i <- w_i - lr lam (w_i - theta) = w_i: zero uploads, the same global
    model, and each client keeps (and predicts with) the global model, bit for bit."""
    algorithm = RecordingPFedMe(lam=LAM, inner_steps=0, global_lr=BETA)
    module, uploads = _fit(algorithm, rounds=3, local=LOCAL)
    start = _initial()
    assert all(torch.equal(p, start[k]) for k, p in module.model.named_parameters())
    assert all(torch.equal(d, torch.zeros_like(d)) for row in uploads for u in row for d in u.values())
    for x, w, theta in algorithm.finished:
        assert all(torch.equal(w[k], x[k]) and torch.equal(theta[k], x[k]) for k in x)
    assert all(torch.equal(module.prediction_params(c)[k], start[k]) for c in range(6) for k in start)


def test_lambda_zero_trains_theta_by_local_sgd_and_keeps_the_global_model():
    """lam = 0, K_in = 1, gamma_v = eta_l: theta takes FedAvg's local steps (so in round 0 it is FedAvg's local
    model x_{i,K} bit for bit) while w_i, and so the global model, stays where it is."""
    local = LocalTraining(lr=0.1, steps=3, batch_size=8)
    pfedme, fedavg = RecordingPFedMe(lam=0.0, inner_steps=1), RecordingFedAvg()
    module, uploads = _fit(pfedme, rounds=2, local=local)
    _fit(fedavg, rounds=1, local=local)
    start = _initial()
    assert all(torch.equal(p, start[k]) for k, p in module.model.named_parameters())
    assert all(torch.equal(d, torch.zeros_like(d)) for row in uploads for u in row for d in u.values())
    assert len(fedavg.finished) == 2 and len(pfedme.finished) == 4
    for (_, _, theta), local_model in zip(pfedme.finished, fedavg.finished):
        assert all(torch.equal(theta[k], local_model[k]) for k in local_model)
        assert _difference(theta, start) > 1e-3


# ---- (c) batched execution ---------------------------------------------------------------------------
def test_batched_execution_equals_sequential():
    result = check_batched(PFedMe(lam=LAM, inner_steps=INNER, global_lr=BETA), local=LOCAL, rounds=3)
    print(f"pFedMe batched vs sequential: {result.max_difference:.1e} at {result.where}")
    assert result.stacked_rule == "elementwise" and result.max_difference < 1e-6


# ---- (d) evaluation uses theta_i -------------------------------------------------------------------------
def test_personalized_evaluation_scores_the_personal_models(fitted, reference):
    x, thetas, _, unseen, data = reference
    assert_evaluation_scores_the_personal_models(fitted[1], x, thetas, unseen, data)


# ---- (e) the config through the CLI --------------------------------------------------------------------
def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path):
    config_fits_through_the_cli(tmp_path, "pfl_pfedme_digits", "PFedMe")


# ---- (f) resume ----------------------------------------------------------------------------------------
def test_resume_continues_the_personal_models_bitwise(tmp_path):
    assert_resume_is_bitwise(tmp_path, lambda: PFedMe(lam=LAM, inner_steps=INNER, global_lr=BETA), local=LOCAL)


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^PFedMe lam must be >= 0, got -1$"):
        PFedMe(lam=-1)
    with pytest.raises(ValueError, match=r"^PFedMe inner_steps must be an integer >= 0, got -1$"):
        PFedMe(inner_steps=-1)
    with pytest.raises(ValueError, match=r"^PFedMe inner_steps must be an integer >= 0, got 2.5$"):
        PFedMe(inner_steps=2.5)

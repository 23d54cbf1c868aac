"""Per-FedAvg (docs/algorithms.md, section 25.6): FO and HF against an independent plain-PyTorch Per-FedAvg,
sequential and batched; alpha = 0 (FO) is FedAvg; HF's finite difference is the Hessian-vector product;
evaluation scores the one-step-adapted model, unseen clients alike; the shipped config through the CLI."""

import re

import pytest
import torch
import torch.nn.functional as F

from fl_lightning import FedAvg
from fl_lightning.algorithms import PerFedAvg
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from models import MLP
from tests.pfl_reference import config_fits_through_the_cli, mlp_grad as _grad, mlp_logits as _logits
from tests.test_pfl_apfl import BATCH, LR, STEPS, _data
from tests.test_pfl_apfl import _fit as apfl_fit

BETA, ROUNDS = LR, 3  # beta is the local lr; the clients and local settings are APFL's test problem


def _fit(algorithm, execution="sequential", rounds=ROUNDS, data=None, **trainer_kw):
    return apfl_fit(algorithm, execution, rounds, data, **trainer_kw)


# ---- an independent Per-FedAvg: plain tensors, the MLP written out, the data module's plans and batches ----
def reference_perfedavg(alpha, variant, delta, rounds=ROUNDS):
    """Fallah et al. (2020), Alg. 1, D = D' = D'' = the step's minibatch; HF's H d by central differences.
    Returns the global model and each client's prediction parameters x - alpha grad f_i(x; its batch)."""
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = _data()
    data.setup()
    for t in range(rounds):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        new_x = dict(x)
        for cid, seed, weight in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            w = dict(x)
            for xb, yb in data.client_batches(cid, seed, BATCH, STEPS):
                g = _grad(w, xb, yb)
                temp = {k: w[k] - alpha * g[k] for k in w}
                d = _grad(temp, xb, yb)
                if variant == "hf":
                    plus = _grad({k: w[k] + delta * d[k] for k in w}, xb, yb)
                    minus = _grad({k: w[k] - delta * d[k] for k in w}, xb, yb)
                    d = {k: d[k] - alpha * (plus[k] - minus[k]) / (2 * delta) for k in w}
                w = {k: w[k] - BETA * d[k] for k in w}
            new_x = {k: new_x[k] + weight * (w[k] - x[k]) for k in x}
        x = new_x
    personalized = {}
    for cid in range(data.num_clients):
        (xb, yb), = data.client_batches(cid, derive_seed(data.seed, cid, PERSONALIZE_STREAM), BATCH, 1, None)
        g = _grad(x, xb, yb)
        personalized[cid] = {k: x[k] - alpha * g[k] for k in x}
    return x, personalized


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_equals_an_independent_reference(variant, execution):
    alpha, delta = 0.3, 1e-2
    module = _fit(PerFedAvg(alpha=alpha, variant=variant, delta=delta), execution)
    if execution == "batched":
        assert not module.executor.inner.fallbacks  # every round ran stacked (the rule is elementwise)
    x, personalized = reference_perfedavg(alpha, variant, delta)
    diffs = [_max_diff({k: v.detach() for k, v in module.global_params().items()}, x)]
    diffs += [_max_diff(module.prediction_params(cid), p) for cid, p in personalized.items()]
    print(f"PerFedAvg {variant} {execution}: max difference {max(diffs):.2e}")
    assert max(diffs) < 1e-6
    assert _max_diff(personalized[0], x) > 1e-3  # the adaptation step moves the model


def test_hf_and_fo_differ_and_batched_equals_sequential_via_check_batched():
    from fl_lightning.experiments.testing import check_batched

    for variant in ("fo", "hf"):
        check = check_batched(PerFedAvg(alpha=0.3, variant=variant, delta=1e-2), tolerance=1e-6)
        print(f"PerFedAvg {variant} check_batched: {check.max_difference:.2e} at {check.where} ({check.stacked_rule})")
        assert check.stacked_rule == "elementwise"
    fo, hf = (_fit(PerFedAvg(alpha=0.3, variant=v)).global_params() for v in ("fo", "hf"))
    assert _max_diff(fo, hf) > 1e-5  # the Hessian term matters here


def test_hf_finite_difference_is_the_hessian_vector_product():
    """HF's step direction d - alpha (grad f(w + delta d) - grad f(w - delta d)) / (2 delta), d = grad f(temp),
    against d - alpha H(w) d with the exact Hessian-vector product (double backward)."""
    from fl_lightning.algorithms.base import ClientContext, RoundInfo

    torch.manual_seed(0)
    w = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    xb, yb = torch.randn(16, 8), torch.randint(0, 3, (16,))
    alpha, delta = 0.5, 1e-3
    ctx = ClientContext(0, {"x": w}, {}, RoundInfo(0, 1.0, 1), 1, grad=lambda p: (None, _grad(p, xb, yb)))  # beta = 1
    stepped, _ = PerFedAvg(alpha=alpha, variant="hf", delta=delta).client_step(w, {}, ctx)
    g = _grad(w, xb, yb)
    d = _grad({k: w[k] - alpha * g[k] for k in w}, xb, yb)
    leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    grads = torch.autograd.grad(F.cross_entropy(_logits(leaves, xb), yb), list(leaves.values()), create_graph=True)
    hd = dict(zip(leaves, torch.autograd.grad(grads, list(leaves.values()), grad_outputs=[d[k] for k in leaves])))
    exact = {k: w[k] - (d[k] - alpha * hd[k]) for k in w}
    error = _max_diff(stepped, exact) / max(float((alpha * v).abs().max()) for v in hd.values())
    print(f"HF finite difference vs exact Hessian-vector product: error {error:.2e} of the Hessian term's size")
    assert error < 1e-2
    assert _max_diff(stepped, {k: w[k] - d[k] for k in w}) > 10 * _max_diff(stepped, exact)  # the term is there


# ---- reductions ------------------------------------------------------------------------------------------
def test_perfedavg_fo_with_alpha_zero_is_fedavg_and_predicts_with_the_global_model():
    for execution in ("sequential", "batched"):
        per, fedavg = _fit(PerFedAvg(alpha=0.0, variant="fo"), execution), _fit(FedAvg(), execution)
        x = per.global_params()
        for k, v in fedavg.global_params().items():
            assert torch.equal(x[k], v), (execution, k)  # both rules apply the same stacked arithmetic
        for cid in range(3):
            params = per.prediction_params(cid)
            assert all(torch.equal(params[k], x[k]) for k in x)


# ---- evaluation scores the adapted model, unseen clients alike ---------------------------------------------------
def test_personalized_accuracy_is_the_adapted_models_and_unseen_clients_adapt_the_same_way():
    data = _data(holdout_fraction=0.3)
    module = _fit(PerFedAvg(alpha=0.5), data=data, rounds=3, limit_val_batches=None, val_check_interval=3, check_val_every_n_epoch=None)
    x = module.global_params()
    personal, shared = [], []
    for cid in range(3):
        inputs, target = data.client_holdout_batch(cid, "validation")
        (xb, yb), = data.client_batches(cid, derive_seed(data.seed, cid, PERSONALIZE_STREAM), BATCH, 1, None)
        g = _grad(x, xb, yb)
        adapted = {k: x[k] - 0.5 * g[k] for k in x}
        personal.append((_logits(adapted, inputs).argmax(-1) == target).double().mean())
        shared.append((_logits(x, inputs).argmax(-1) == target).double().mean())
        unseen = module.unseen_prediction_params(cid)  # one discarded local round, then the same adaptation
        assert all(torch.equal(unseen[k], v) for k, v in module.prediction_params(cid).items())
    logged = float(module.trainer.callback_metrics["val/personal_acc_mean"])
    assert logged == pytest.approx(float(torch.stack(personal).mean()), abs=1e-6)
    assert abs(logged - float(torch.stack(shared).mean())) > 0.02  # the global model would score otherwise


# ---- the shipped config through the CLI ------------------------------------------------------------------------
def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path):
    config_fits_through_the_cli(tmp_path, "pfl_perfedavg_digits", "PerFedAvg")


# ---- settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,message",
    [({"variant": "so"}, "PerFedAvg variant must be one of ['fo', 'hf'], got 'so'"), ({"alpha": -0.1}, "PerFedAvg alpha must be >= 0, got -0.1"),
     ({"delta": 0.0}, "PerFedAvg delta must be > 0, got 0.0")],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        PerFedAvg(**kw)
    assert "\n" not in str(error.value)

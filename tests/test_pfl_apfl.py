"""APFL (docs/algorithms.md, section 25.5): the rule against an independent plain-PyTorch APFL, sequential and
batched; alpha = 0 is FedAvg; the mixed model is what evaluation scores; the shipped config through the CLI;
the personal state (v_i, alpha_i) survives a resume bit for bit."""

import re

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import APFL
from models import MLP
from tests.pfl_reference import config_fits_through_the_cli, mlp_grad as _grad, mlp_logits as _logits
from tests.conftest import tiny_datamodule, tiny_trainer

LR, STEPS, BATCH, ROUNDS = 0.1, 3, 8, 4


def _data(**kw):
    """3 clients, 2 of them per round (uniform weights 1/2): a client sits out some rounds."""
    return tiny_datamodule(num_clients=3, clients_per_round=2, **kw)


def _fit(algorithm, execution="sequential", rounds=ROUNDS, data=None, **trainer_kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=BATCH), execution=execution)
    tiny_trainer("/tmp/unused", rounds, **trainer_kw).fit(module, datamodule=data or _data())
    return module


# ---- an independent APFL: plain tensors, the MLP written out, the data module's round plans and batches ----
def reference_apfl(alpha0, adaptive, alpha_lr, rounds=ROUNDS):
    """Deng et al. (2020), Alg. 1 with the alpha update of Sec. 3, every update from the iterates before the step.
    Returns the global model, and per client (v_i, alpha_i) for the clients that trained."""
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = _data()
    data.setup()
    states = {}
    for t in range(rounds):
        plan = data.participation.plan(t, data.client_sizes, data.seed)
        new_x = dict(x)
        for cid, seed, weight in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            v, a = states.get(cid, ({k: t.clone() for k, t in x.items()}, torch.tensor(alpha0)))
            w = dict(x)
            for xb, yb in data.client_batches(cid, seed, BATCH, STEPS):
                g_w = _grad(w, xb, yb)
                vbar = {k: a * v[k] + (1 - a) * w[k] for k in w}
                g_vbar = _grad(vbar, xb, yb)
                a_next = a
                if adaptive:
                    slope = sum(((v[k] - w[k]) * g_vbar[k]).sum() for k in w)
                    a_next = torch.clamp(a - (alpha_lr or LR) * slope, 0.0, 1.0)
                v = {k: v[k] - LR * a * g_vbar[k] for k in v}
                w = {k: w[k] - LR * g_w[k] for k in w}
                a = a_next
            states[cid] = (v, a)
            new_x = {k: new_x[k] + weight * (w[k] - x[k]) for k in x}
        x = new_x
    return x, states


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


SETTINGS = {
    "adaptive": dict(alpha=0.5, adaptive_alpha=True, alpha_lr=None),
    "adaptive_clipped": dict(alpha=0.9, adaptive_alpha=True, alpha_lr=20.0),
    "fixed": dict(alpha=0.3, adaptive_alpha=False, alpha_lr=None),
}


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_apfl_equals_an_independent_reference(setting, execution):
    kw = SETTINGS[setting]
    module = _fit(APFL(**kw), execution)
    if execution == "batched":
        assert not module.executor.inner.fallbacks  # the rule ran per client under vmap, every round
    x, states = reference_apfl(kw["alpha"], kw["adaptive_alpha"], kw["alpha_lr"])
    diffs = [_max_diff({k: v.detach() for k, v in module.global_params().items()}, x)]
    assert set(module.store.client_ids()) == set(states)
    for cid, (v, a) in states.items():
        stored = module.store.get(cid, None)
        diffs += [_max_diff(stored["v"], v), float((stored["alpha"]["alpha"] - a).abs())]
        mixed = {k: a * v[k] + (1 - a) * x[k] for k in x}  # (25.5.5): with the global model at evaluation
        diffs.append(_max_diff(module.prediction_params(cid), mixed))
    print(f"APFL {setting} {execution}: max difference {max(diffs):.2e}")
    assert max(diffs) < 1e-6
    alphas = [float(a) for _, a in states.values()]
    if setting == "adaptive":
        assert all(0 < a < 1 and a != 0.5 for a in alphas)  # learned, not clipped
    elif setting == "adaptive_clipped":
        assert any(a in (0.0, 1.0) for a in alphas)  # the clip is exercised
    else:
        assert alphas == [pytest.approx(0.3)] * len(alphas)


def test_apfl_under_batched_execution_equals_sequential_via_check_batched():
    from fl_lightning.experiments.testing import check_batched

    check = check_batched(APFL(alpha=0.5, alpha_lr=1.0), tolerance=1e-6)
    print(f"APFL check_batched: {check.max_difference:.2e} at {check.where} ({check.stacked_rule})")
    assert check.stacked_rule == "vmap"  # not elementwise: the alpha update's inner product is a reduction


# ---- reductions ------------------------------------------------------------------------------------------
def test_apfl_with_alpha_zero_is_fedavg_and_predicts_with_the_global_model():
    for execution in ("sequential", "batched"):
        apfl, fedavg = _fit(APFL(alpha=0.0, adaptive_alpha=False), execution), _fit(FedAvg(), execution)
        x = apfl.global_params()
        for k, v in fedavg.global_params().items():
            if execution == "sequential":
                assert torch.equal(x[k], v), (execution, k)
            else:  # APFL stacks under vmap, FedAvg elementwise: their float32 sums may round differently by CPU
                assert torch.allclose(x[k], v, rtol=0, atol=1e-6), (execution, k)
        for cid in range(3):
            params = apfl.prediction_params(cid)
            assert all(torch.equal(params[k], x[k]) for k in x)


def test_apfl_global_model_is_fedavgs_for_any_alpha():
    """(25.5.1) reads neither v_i nor alpha_i: the shared path is FedAvg bit for bit while v_i and alpha_i move."""
    apfl, fedavg = _fit(APFL(alpha=0.5)), _fit(FedAvg())
    x = apfl.global_params()
    assert all(torch.equal(x[k], v) for k, v in fedavg.global_params().items())
    assert all(float(apfl.store.get(c, None)["alpha"]["alpha"]) != 0.5 for c in apfl.store.client_ids())
    assert all(_max_diff(apfl.prediction_params(c), x) > 1e-3 for c in range(3))  # the clients' own models


def test_apfl_with_alpha_one_fixed_trains_v_as_local_sgd_from_its_own_model():
    """alpha = 1 (not adaptive): vbar = v, so v_i follows plain local SGD of its own, carried across rounds."""
    module = _fit(APFL(alpha=1.0, adaptive_alpha=False), rounds=2)
    _, states = reference_apfl(1.0, False, None, rounds=2)
    for cid, (v, _) in states.items():
        assert _max_diff(module.prediction_params(cid), v) < 1e-6


# ---- evaluation scores the mixed model -------------------------------------------------------------------------
def test_personalized_accuracy_is_the_mixed_models_not_the_global_models():
    data = _data(holdout_fraction=0.3)
    rounds = 4
    module = _fit(APFL(alpha=0.8, adaptive_alpha=False), data=data, rounds=rounds, limit_val_batches=None,
                  val_check_interval=rounds, check_val_every_n_epoch=None)  # fmt: skip
    x = module.global_params()
    personal, shared = [], []
    for cid in range(3):
        inputs, target = data.client_holdout_batch(cid, "validation")
        stored = module.store.get(cid, None)
        mixed = {k: 0.8 * stored["v"][k] + (1 - 0.8) * x[k] for k in x}
        personal.append((_logits(mixed, inputs).argmax(-1) == target).double().mean())
        shared.append((_logits(x, inputs).argmax(-1) == target).double().mean())
    logged = float(module.trainer.callback_metrics["val/personal_acc_mean"])
    assert logged == pytest.approx(float(torch.stack(personal).mean()), abs=1e-6)
    assert abs(logged - float(torch.stack(shared).mean())) > 0.02  # the global model would score otherwise


# ---- the shipped config through the CLI ------------------------------------------------------------------------
def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path):
    config_fits_through_the_cli(tmp_path, "pfl_apfl_digits", "APFL")


# ---- resume: v_i and alpha_i are client state ---------------------------------------------------------------------
def test_apfl_resumes_bitwise(tmp_path):
    def run(directory, rounds, ckpt_path=None):
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), APFL(alpha=0.5, alpha_lr=1.0), LocalTraining(lr=LR, steps=STEPS, batch_size=BATCH))
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=4, clients_per_round=2), ckpt_path=ckpt_path)
        return module

    straight, first = run(tmp_path / "a", 4), run(tmp_path / "b", 2)
    resumed = run(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)
    assert not first.store.equal(straight.store)  # rounds 3-4 changed the stored (v_i, alpha_i)
    assert any(float(straight.store.get(c, None)["alpha"]["alpha"]) != 0.5 for c in straight.store.client_ids())


# ---- settings ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,message",
    [({"alpha": 1.5}, "APFL alpha must be in [0, 1], got 1.5"), ({"alpha_lr": 0.0}, "APFL alpha_lr must be > 0"),
     ({"adaptive_alpha": "yes"}, "APFL adaptive_alpha must be true or false")],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        APFL(**kw)
    assert "\n" not in str(error.value)

"""FedRoD (Chen & Chao, ICLR 2022; docs/algorithms.md, 25.9): the generic model trained with the balanced
softmax and averaged, a personal linear head on the detached representation kept as client state; against
an independent plain-PyTorch FedRoD."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.func import functional_call

from fl_lightning import FedAvg
from fl_lightning.algorithms import FedRoD
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from tests.conftest import tiny_trainer, assert_resumes_bitwise
from tests.pfl_reference import (
    BATCH, LR, ROUNDS, STEPS, assert_personal_metrics, cnn, data, fit, fit_config, max_difference, record_uploads, shared_params,
)  # fmt: skip

W, B = "classifier.2.weight", "classifier.2.bias"


def reference_fedrod():
    """Per step, on one minibatch at the current (u, W_g, b_g) and personal head (W_p, b_p):
    z = representation, o = W_g z + b_g; the model steps on CE(o + log n_c, y), the personal head on
    CE(o.detach() + W_p z.detach() + b_p, y), both by SGD with the local lr. Personal heads start at zero;
    the server averages the models. A client predicts with o + W_p z + b_p."""
    d = data()
    d.setup()
    model = cnn()
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    heads = {}

    def features(p, inputs):
        h = functional_call(model.features, {k[len("features."):]: v for k, v in p.items() if k.startswith("features.")}, (inputs,))
        return torch.relu(F.linear(h, p["classifier.0.weight"], p["classifier.0.bias"]))

    def local_round(cid, seed, x, head):
        p, (wp, bp) = dict(x), head
        log_counts = d.client_label_counts(cid).float().clamp(min=1e-8).log()
        for inputs, target in d.client_batches(cid, seed, BATCH, STEPS):
            leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
            wp, bp = wp.clone().requires_grad_(True), bp.clone().requires_grad_(True)
            z = features(leaves, inputs)
            o = F.linear(z, leaves[W], leaves[B])
            generic = F.cross_entropy(o + log_counts, target)
            personal = F.cross_entropy(o.detach() + F.linear(z.detach(), wp, bp), target)
            g = torch.autograd.grad(generic, list(leaves.values()))
            gw, gb = torch.autograd.grad(personal, [wp, bp])
            p = {k: (v - LR * gk).detach() for (k, v), gk in zip(leaves.items(), g)}
            wp, bp = (wp - LR * gw).detach(), (bp - LR * gb).detach()
        return p, (wp, bp)

    zero = (torch.zeros_like(x[W]), torch.zeros_like(x[B]))
    for t in range(ROUNDS):
        plan = d.participation.plan(t, d.client_sizes, d.seed)
        new_x = dict(x)
        for cid, seed, w in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            p, heads[cid] = local_round(cid, seed, x, heads.get(cid, zero))
            new_x = {n: new_x[n] + w * (p[n] - x[n]) for n in x}
        x = new_x

    def logits(cid, inputs, head=None):
        wp, bp = head or heads.get(cid, zero)
        z = features(x, inputs)
        return F.linear(z, x[W], x[B]) + F.linear(z, wp, bp)

    def unseen_head(cid, round_idx):
        return local_round(cid, derive_seed(d.seed, cid, round_idx, PERSONALIZE_STREAM), x, zero)[1]

    return x, heads, logits, unseen_head, d


def test_fedrod_equals_an_independent_reference():
    module = fit(FedRoD())
    x, heads, logits, unseen_head, d = reference_fedrod()
    trained = sorted(module.store.client_ids())
    assert trained == sorted(heads) and len(trained) >= 3
    differences = {
        "global": max_difference(shared_params(module), x),
        "personal_head": max(max_difference(module.store.get(c, None)["personal_head"], dict(zip((W, B), heads[c]))) for c in trained),
        "predict": max(max_difference(module.prediction_params(c), {**x, W: x[W] + heads.get(c, (0, 0))[0], B: x[B] + heads.get(c, (0, 0))[1]})
                       for c in range(d.num_clients)),  # fmt: skip
    }
    # The personalized logits o + W_p z + b_p of the reference = the model's logits with the head W_g + W_p, b_g + b_p.
    inputs, _ = d.client_holdout_batch(trained[0])
    with torch.no_grad():
        _, predicted, _ = module.objective.at(module.prediction_params(trained[0]), d.client_holdout_batch(trained[0]))
    differences["logits"] = float((predicted - logits(trained[0], inputs)).abs().max())
    unseen = d.unseen_clients[0]
    head = unseen_head(unseen, module.global_step - 1)
    differences["unseen"] = max_difference(module.unseen_prediction_params(unseen), {**x, W: x[W] + head[0], B: x[B] + head[1]})
    print("FedRoD vs reference:", differences)
    assert max(differences.values()) < 1e-5 and max(v for k, v in differences.items() if k != "logits") < 1e-6
    assert min(float(heads[c][0].abs().max()) for c in trained) > 1e-3  # the personal heads moved: the global model would fail above


class BalancedSoftmaxOnly(FedAvg):
    """FedAvg with FedRoD's generic loss alone."""

    needs_label_counts = True

    def local_loss(self, out, target, ctx):
        return {"balanced_ce": F.cross_entropy(out.logits + ctx.label_counts.to(out.logits.dtype).clamp(min=1e-8).log(), target)}


def test_the_personal_head_does_not_touch_the_generic_model():
    """The generic model is FedAvg with the balanced softmax alone, bit for bit: the personal term reads the
    representation and the generic logits detached. Only the model is uploaded, never the personal head."""
    algorithm = FedRoD()
    uploads = record_uploads(algorithm)
    rod, balanced = fit(algorithm), fit(BalancedSoftmaxOnly())
    for name, value in balanced.model.named_parameters():
        assert torch.equal(value.detach(), rod.model.get_parameter(name).detach()), name
    assert uploads and all(set(u) == {"delta"} and set(u["delta"]) == set(rod.federated_names) for u in uploads)


def test_a_client_that_never_trained_predicts_with_the_generic_model():
    module = fit(FedRoD(), rounds=1)
    never = next(c for c in range(module.datamodule.num_clients) if c not in module.store.client_ids())
    assert max_difference(module.prediction_params(never), shared_params(module)) == 0.0


def test_batched_equals_sequential():
    """Elementwise rule, loss per client under vmap, SmallCNN as client rows: no fallback."""
    seq, bat = fit(FedRoD(), execution="sequential"), fit(FedRoD(), execution="batched")
    assert not bat.executor.inner.fallbacks and bat.objective.rows is not None
    difference = max_difference(shared_params(seq), shared_params(bat))
    heads = max(max_difference(seq.store.get(c, None)["personal_head"], bat.store.get(c, None)["personal_head"]) for c in seq.store.client_ids())
    print(f"FedRoD batched vs sequential: global {difference:.2e}, personal heads {heads:.2e}")
    assert sorted(seq.store.client_ids()) == sorted(bat.store.client_ids()) and max(difference, heads) < 1e-6


def test_the_personal_heads_resume_bitwise(tmp_path):
    from fl_lightning import FederatedModule, LocalTraining

    def run(directory, rounds, ckpt_path=None):
        module = FederatedModule(cnn(), FedRoD(), LocalTraining(lr=LR, steps=STEPS, batch_size=BATCH))
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=data(), ckpt_path=ckpt_path)
        return module

    straight, resumed = assert_resumes_bitwise(run, tmp_path, min_clients=4)
    assert all("personal_head" in straight.store.get(c, None) for c in straight.store.client_ids())


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="FedRoD head must be a non-empty list"):
        FedRoD(head=[])
    with pytest.raises(ValueError, match="FedRoD head \\['features'\\] must match one linear layer's weight"):
        fit(FedRoD(head=["features"]), rounds=1)


def test_the_config_fits_through_the_cli_and_logs_its_terms_and_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    import math

    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_fedrod_digits")
    assert type(cli.model.algorithm) is FedRoD
    assert_personal_metrics(rows)
    trained = [r for r in rows if r.get("train/loss")]
    assert len(trained) == 3
    for row in trained:
        terms = float(row["train/loss/balanced_ce"]) + float(row["train/loss/personal_ce"])
        assert math.isclose(terms, float(row["train/loss"]), rel_tol=1e-6)

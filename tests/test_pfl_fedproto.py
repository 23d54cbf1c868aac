"""FedProto (docs/algorithms.md, section 25.10): against an independent plain-PyTorch FedProto, its
reduction (lambda = 0: local training), batched execution (declared fallback), the model clients predict
with, unseen clients, the config through the CLI, resume, and its refusals."""

import csv
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import Shards
from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import FedProto
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
LR, STEPS, BATCH, ROUNDS, CLIENTS = 0.2, 3, 16, 3, 3


def _data(**kw):
    """Three clients, all training every round (full participation), each holding one shard of the
    label-sorted samples (one or two of the 3 classes), 30% held out; ``new_client_fraction`` adds unseen ones."""
    return tiny_datamodule(num_clients=CLIENTS, clients_per_round=CLIENTS, partition=Shards(1), holdout_fraction=0.3, **kw)


class Recording(FedProto):
    """FedProto that records every upload (the rule's own client_finish, unchanged)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.uploads = []

    def client_finish(self, params, local, ctx):
        upload, state = super().client_finish(params, local, ctx)
        self.uploads.append((ctx.client_id, upload))
        return upload, state


def _fit(algorithm, execution="sequential", rounds=ROUNDS, data=None, directory="/tmp/unused", **trainer_kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=BATCH), execution=execution)
    data = data if data is not None else _data()
    trainer = tiny_trainer(directory, rounds, **trainer_kw)
    trainer.fit(module, datamodule=data)
    return module, data, trainer


# ---- an independent FedProto: plain tensors, PFLlib's loss, the paper's Eq. 6 -------------------------------
def _mlp(p, x):
    """MLP(8, 3, hidden=[16]) written out: (representation z, logits)."""
    z = torch.relu(x @ p["net.1.weight"].T + p["net.1.bias"])
    return z, z @ p["net.3.weight"].T + p["net.3.bias"]


def _local_round(p, batches, lam, protos):
    """K SGD steps on CE + lam * MSE(z, z with each sample's global prototype written in) (PFLlib's clientproto)."""
    for inputs, target in batches:
        leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
        z, logits = _mlp(leaves, inputs)
        loss = F.cross_entropy(logits, target)
        if protos:  # no prototype at all before the first aggregation: CE alone
            wanted = z.detach().clone()
            for i, y in enumerate(target.tolist()):
                if y in protos:
                    wanted[i] = protos[y]
            loss = loss + lam * F.mse_loss(wanted, z)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        p = {k: (v - LR * g).detach() for (k, v), g in zip(leaves.items(), grads)}
    return p


def _prototypes(p, inputs, target):
    """The class means of z over the client's training set, and the class counts (PFLlib's collect_protos)."""
    z = _mlp(p, inputs)[0]
    return {c: z[target == c].mean(0) for c in target.unique().tolist()}, {c: int((target == c).sum()) for c in target.unique().tolist()}


def reference_fedproto(lam, rounds=ROUNDS, data_fn=_data):
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = data_fn()
    data.setup()
    models, protos, uploads = [dict(x) for _ in range(data.num_clients)], {}, []
    for round_idx in range(rounds):
        sent = []
        for cid in range(data.num_clients):
            batches = data.client_batches(cid, derive_seed(data.seed, round_idx, cid), BATCH, STEPS)
            models[cid] = _local_round(models[cid], batches, lam, protos)
            sent.append(_prototypes(models[cid], *data.client_full_batch(cid)))
        uploads.append(sent)
        protos = {}  # Eq. 6: C_c = sum_i |D_ic| / N_c C_c^(i), over the clients that hold class c
        for c in range(3):
            total = sum(counts.get(c, 0) for _, counts in sent)
            if total:
                protos[c] = sum(counts[c] / total * means[c] for means, counts in sent if c in counts)
    return x, models, protos, uploads, data


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _server_protos(module):
    state = module.server_state["prototypes"]
    return {c: state["value"][c] for c in range(3) if state["present"][c] > 0}, state


@pytest.fixture(scope="module")
def reference():
    return reference_fedproto(1.0)


def test_fedproto_equals_an_independent_reference(reference):
    x0, models, protos, uploads, _ = reference
    algorithm = Recording(lam=1.0)
    module, data, _ = _fit(algorithm)
    diffs = [_max_diff(module.prediction_params(cid), models[cid]) for cid in range(CLIENTS)]  # the prediction params
    diffs += [_max_diff(module.store.get(cid, dict)["model"], models[cid]) for cid in range(CLIENTS)]  # the client states
    got, state = _server_protos(module)
    assert sorted(got) == sorted(protos) == [0, 1, 2]
    diffs.append(max(float((got[c] - protos[c]).abs().max()) for c in protos))
    for round_idx in range(ROUNDS):  # every upload: prototypes and counts, 0 for a class the client lacks
        for cid, upload in algorithm.uploads[round_idx * CLIENTS : (round_idx + 1) * CLIENTS]:
            means, counts = uploads[round_idx][cid]
            sent = upload["prototypes"]
            assert sent["count"].tolist() == [float(counts.get(c, 0)) for c in range(3)]
            for c in range(3):
                diffs.append(float((sent["value"][c] - means.get(c, torch.zeros(16))).abs().max()))
    assert any(len(uploads[0][cid][1]) < 3 for cid in range(CLIENTS))  # some client lacks a class: the weighting matters
    print(f"FedProto vs reference: max difference {max(diffs):.2e}")
    assert max(diffs) < 1e-6
    for k, v in module.model.named_parameters():  # the global model never changes (pseudo-gradient 0)
        assert torch.equal(v.detach(), x0[k])


def test_the_local_loss_skips_classes_without_a_global_prototype():
    algorithm = FedProto(lam=2.0)
    z = torch.randn(4, 5, requires_grad=True)
    logits, target = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    value, present = torch.randn(3, 5), torch.tensor([1.0, 0.0, 1.0])
    from fl_lightning.core.local_loss import LossContext, ModelOutputs

    ctx = LossContext(0, {"prototypes": {"value": value, "present": present}}, {}, None, None, None)
    terms = algorithm.local_loss(ModelOutputs(logits, z), target, ctx)
    expected = 2.0 * (((z[0] - value[0]) ** 2).sum() + ((z[2] - value[2]) ** 2).sum()) / 20  # samples 1 and 3: class 1, absent
    torch.testing.assert_close(terms["proto"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(terms["ce"], F.cross_entropy(logits, target))
    (grad,) = torch.autograd.grad(terms["proto"], z)
    assert torch.equal(grad[1], torch.zeros(5)) and torch.equal(grad[3], torch.zeros(5))


def test_aggregation_weighs_prototypes_by_class_counts_and_marks_absent_classes():
    algorithm = FedProto()
    x = {"w": torch.zeros(3, 2)}  # C = 3, d = 2 from the last weight matrix
    uploads = [{"prototypes": {"value": torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]), "count": torch.tensor([3.0, 0.0, 0.0])}},
               {"prototypes": {"value": torch.tensor([[5.0, 1.0], [2.0, 4.0], [0.0, 0.0]]), "count": torch.tensor([1.0, 2.0, 0.0])}}]  # fmt: skip
    sums = algorithm.upload_sum(x, uploads, [0.9, 0.1], None)  # the plan's weights are not used
    halves = [algorithm.upload_sum(x, [u], [1.0], None) for u in uploads]  # additive over disjoint sets (DDP)
    assert all(torch.equal(sums["prototypes"][k], halves[0]["prototypes"][k] + halves[1]["prototypes"][k]) for k in ("weighted", "count"))
    none = algorithm.upload_sum(x, [], [], None)
    assert none["prototypes"]["weighted"].shape == (3, 2) and not none["prototypes"]["count"].any()
    pseudo_grad, state = algorithm.aggregate_sum(x, sums, algorithm.server_state_init(x), None, [1, 1])
    assert torch.equal(pseudo_grad["w"], torch.zeros(3, 2))
    torch.testing.assert_close(state["prototypes"]["value"], torch.tensor([[2.0, 1.0], [2.0, 4.0], [0.0, 0.0]]))
    assert state["prototypes"]["present"].tolist() == [1.0, 1.0, 0.0]


def test_lambda_zero_is_local_training(tmp_path):
    """lambda = 0: each client's model is its own local SGD from x on CE alone, whatever the prototypes."""
    module, data, _ = _fit(FedProto(lam=0.0))
    torch.manual_seed(0)
    x = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    for cid in range(CLIENTS):
        p = dict(x)
        for round_idx in range(ROUNDS):
            p = _local_round(p, data.client_batches(cid, derive_seed(data.seed, round_idx, cid), BATCH, STEPS), 0.0, {})
        assert _max_diff(module.store.get(cid, dict)["model"], p) < 1e-6
    assert module.server_state["prototypes"]["present"].tolist() == [1.0, 1.0, 1.0]  # computed and aggregated all the same


def test_batched_execution_stacks_the_clients_and_equals_sequential():
    batched, _, _ = _fit(FedProto(lam=1.0), "batched")
    assert not batched.executor.inner.fallbacks  # local steps stacked; the data pass of client_finish client by client
    sequential, _, _ = _fit(FedProto(lam=1.0))
    difference = 0.0
    for cid in sequential.store.client_ids():
        for name, td in sequential.store.get(cid, dict).items():
            for k, v in td.items():
                difference = max(difference, float((batched.store.get(cid, dict)[name][k] - v).abs().max()))
    for k, v in sequential.server_state["prototypes"].items():
        difference = max(difference, float((batched.server_state["prototypes"][k] - v).abs().max()))
    assert difference < 1e-5, difference
    print(f"FedProto batched vs sequential: max difference {difference:.1e}")


def test_clients_are_scored_with_their_own_model_not_the_global_one(tmp_path, reference):
    """val/personal_acc_mean is the reference's client models' accuracy on their held-out data; the
    global model (the initial one) scores differently, so evaluating it instead would fail."""
    _, models, _, _, _ = reference
    module, data, trainer = _fit(FedProto(lam=1.0), directory=tmp_path, limit_val_batches=None, val_check_interval=ROUNDS,
                                 check_val_every_n_epoch=None)  # fmt: skip
    own, glob = [], []
    x = {k: v.detach() for k, v in module.model.named_parameters()}
    for cid in range(CLIENTS):
        inputs, target = data.client_holdout_batch(cid, "validation")
        own.append(float((_mlp(models[cid], inputs)[1].argmax(-1) == target).double().mean()))
        glob.append(float((_mlp(x, inputs)[1].argmax(-1) == target).double().mean()))
    assert float(trainer.callback_metrics["val/personal_acc_mean"]) == pytest.approx(sum(own) / CLIENTS, abs=1e-6)
    assert abs(sum(own) - sum(glob)) / CLIENTS > 0.1


def test_an_unseen_client_trains_one_round_from_the_initial_model_against_the_global_prototypes(tmp_path):
    data = _data(new_client_fraction=0.25)  # 4 partitioned clients: 3 train, 1 unseen
    module, data, trainer = _fit(FedProto(lam=1.0), data=data, directory=tmp_path, limit_val_batches=None,
                                 val_check_interval=ROUNDS, check_val_every_n_epoch=None)  # fmt: skip
    (cid,) = data.unseen_clients
    x = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    protos, _ = _server_protos(module)
    seed = derive_seed(data.seed, cid, ROUNDS - 1, PERSONALIZE_STREAM)
    expected = _local_round(dict(x), data.client_batches(cid, seed, BATCH, STEPS), 1.0, protos)
    got = module.unseen_prediction_params(cid)
    assert _max_diff(got, expected) < 1e-6 and _max_diff(got, x) > 1e-3
    inputs, target = data.client_holdout_batch(cid, "validation")
    accuracy = float((_mlp(expected, inputs)[1].argmax(-1) == target).double().mean())
    assert float(trainer.callback_metrics["val/unseen_acc_mean"]) == pytest.approx(accuracy, abs=1e-6)


def test_config_fits_through_the_cli_with_personalized_and_unseen_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
            "--model.local.steps", "2"]  # fmt: skip
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / "pfl_fedproto_digits.yaml"), *args])
    assert type(cli.model.algorithm) is FedProto and cli.model.algorithm.lam == 1.0 and cli.trainer.global_step == 3
    with open(tmp_path / "runs" / "pfl_fedproto_digits" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = [r for r in rows if r.get("val/personal_acc_mean")]
    assert evaluated, "no personalized evaluation row"
    for name in ("val/personal_acc_mean", "val/personal_acc_weighted", "val/personal_acc_worst10", "val/unseen_acc_mean"):
        assert 0.0 <= float(evaluated[-1][name]) <= 1.0, name
    trained = [r for r in rows if r.get("train/loss")]
    assert 0 < float(trained[-1]["algo/classes_with_prototype"]) <= 10  # classes held by the round's 5 clients
    assert float(trained[-1]["train/loss/proto"]) > 0  # the prototypes of round 0 pull from round 1 on


def _fit_checkpointed(directory, rounds, ckpt_path=None):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedProto(lam=1.0), LocalTraining(lr=LR, steps=STEPS, batch_size=8))
    checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=4, clients_per_round=2), ckpt_path=ckpt_path)
    return module


def test_resume_continues_bitwise(tmp_path):
    """The clients' models (client state) and the global prototypes (server state) are checkpointed."""
    straight = _fit_checkpointed(tmp_path / "a", 4)
    _fit_checkpointed(tmp_path / "b", 2)
    resumed = _fit_checkpointed(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)
    for k in ("value", "present"):
        assert torch.equal(straight.server_state["prototypes"][k], resumed.server_state["prototypes"][k])
    assert straight.server_state["prototypes"]["present"].sum() > 0


def test_settings_and_model_update_stages_are_refused_in_one_line(tmp_path):
    from fl_lightning.compression import Compression, TopK
    from fl_lightning.pipeline.privacy import ClientPrivacy

    for bad, match in [(dict(lam=-1.0), r"FedProto lam must be >= 0, got -1.0"),
                       (dict(num_classes=0), r"FedProto num_classes must be an integer >= 1"),
                       (dict(feature_dim=2.5), r"FedProto feature_dim must be an integer >= 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            FedProto(**bad)
    stages = {"privacy": dict(privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0)),
              "compression.up": dict(compression=Compression(up=TopK(ratio=0.5)))}  # fmt: skip
    for name, kw in stages.items():
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), FedProto(), LocalTraining(lr=LR, steps=2, batch_size=8), **kw)
        with pytest.raises(ValueError, match="not shaped like the model") as error:
            tiny_trainer(tmp_path / name, 1).fit(module, datamodule=tiny_datamodule())
        assert "\n" not in str(error.value) and "FedProto" in str(error.value)


def test_a_wrong_prototype_shape_is_refused_in_one_line(tmp_path):
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedProto(num_classes=3, feature_dim=7), LocalTraining(lr=LR, steps=2, batch_size=8))
    with pytest.raises(ValueError, match=r"FedProto prototypes are \[3, 7\] but the model gives 3 classes and 16 features"):
        tiny_trainer(tmp_path, 1).fit(module, datamodule=tiny_datamodule())


def test_ddp_two_processes_sum_the_prototypes_as_one_process(tmp_path):
    """FedProto over 2 DDP processes (gloo, CPU): the uploads (no model delta) are summed and all-reduced
    (linear_aggregate), and the global prototypes, the client models and the metrics equal one process's."""
    from tests.test_distributed import _assert_close, _train

    single, ddp = _train(tmp_path, 1, "fedproto", False), _train(tmp_path, 2, "fedproto", False)
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert ddp["exchanges"]["summed"] == 3 and single["server_state"]["prototypes/present"].sum() > 0
    for name in ("train/loss", "train/loss/proto", "train/consistency", "comm/round_bytes_up", "algo/classes_with_prototype"):
        assert ddp["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5), name

"""The local-objective contract (fl_lightning/core/local_loss.py) and the algorithms written through it
(docs/algorithms.md, sections 19-24): each against an independent plain-PyTorch reference, sequential
and batched, and their reductions to FedAvg (bitwise, sequential)."""

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from datamodules import Shards
from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import MOON, FedDecorr, FedLC, FedNTD, FedRS
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.participation import derive_seed
from models import MLP, SmallCNN
from tests.conftest import tiny_datamodule, tiny_trainer, assert_resumes_bitwise

ROOT = Path(__file__).resolve().parents[1]
LR, STEPS, ROUNDS, BATCH = 0.1, 3, 2, 16


def _data():
    """Two clients of 150 samples each, both training every round (weights 1/2), each missing one
    of the 3 classes (one shard of the label-sorted samples each)."""
    return tiny_datamodule(num_clients=2, clients_per_round=2, partition=Shards(1))


def _fit(algorithm, execution, rounds=ROUNDS, model_fn=lambda: MLP(8, 3, hidden=[16]), data_fn=_data, batch_size=BATCH):
    torch.manual_seed(0)
    module = FederatedModule(model_fn(), algorithm, LocalTraining(lr=LR, steps=STEPS, batch_size=batch_size), execution=execution)
    tiny_trainer("/tmp/unused", rounds).fit(module, datamodule=data_fn())
    return module


def _params(module):
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}


# ---- an independent reference: plain tensors, local SGD on the clients' minibatches, FedAvg's server ----
def _mlp(p, x):
    """MLP(8, 3, hidden=[16]) written out: (representation z, logits)."""
    z = torch.relu(x @ p["net.1.weight"].T + p["net.1.bias"])
    return z, z @ p["net.3.weight"].T + p["net.3.bias"]


def _reference(loss, finish=lambda p, state: None, rounds=ROUNDS):
    """``rounds`` rounds of 2 clients, K SGD steps on ``loss(p, x, y, global, state)`` over the client's
    round's minibatches (the samples the data module draws from its round seed); ``finish(p, state)``
    updates a client's state (``state["counts"]``: its samples per class); the server averages the two models."""
    torch.manual_seed(0)
    x_global = {k: v.detach().clone() for k, v in MLP(8, 3, hidden=[16]).named_parameters()}
    data = _data()
    data.setup()
    states = [{"counts": torch.bincount(data.client_full_batch(c)[1], minlength=3)} for c in range(2)]
    for round_idx in range(rounds):
        finals = []
        for cid in range(2):
            p = {k: v.clone() for k, v in x_global.items()}
            for x, y in data.client_batches(cid, derive_seed(data.seed, round_idx, cid), BATCH, STEPS):
                leaves = {k: v.requires_grad_(True) for k, v in p.items()}
                grads = torch.autograd.grad(loss(leaves, x, y, x_global, states[cid]), list(leaves.values()))
                p = {k: (v - LR * g).detach() for (k, v), g in zip(leaves.items(), grads)}
            finish(p, states[cid])
            finals.append(p)
        x_global = {k: x_global[k] + ((finals[0][k] - x_global[k]) + (finals[1][k] - x_global[k])) / 2 for k in x_global}
    return x_global


def _max_difference(module, reference):
    return max(float((module.model.get_parameter(k).detach() - v).abs().max()) for k, v in reference.items())


def fedavg_reference():
    return _reference(lambda p, x, y, x_global, state: F.cross_entropy(_mlp(p, x)[1], y))


# ---- MOON (section 19) ------------------------------------------------------------------------------
def _cosine(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def moon_reference(mu, tau):
    def loss(p, x, y, x_global, state):
        z, logits = _mlp(p, x)
        z_global = _mlp(x_global, x)[0]
        z_previous = _mlp(state.get("previous", x_global), x)[0]  # the global model at the client's first round
        positive, negative = torch.exp(_cosine(z, z_global) / tau), torch.exp(_cosine(z, z_previous) / tau)
        return F.cross_entropy(logits, y) - mu * torch.log(positive / (positive + negative)).mean()

    def finish(p, state):
        state["previous"] = p

    return _reference(loss, finish)


# ---- FedNTD (section 20), FedLC (21), FedRS (22), FedDecorr (23) ----------------------------------------
def fedntd_reference(beta, tau):
    def loss(p, x, y, x_global, state):
        logits, teacher = _mlp(p, x)[1], _mlp(x_global, x)[1]
        others = ~F.one_hot(y, 3).bool()  # the not-true classes, by a mask
        log_q = F.log_softmax(logits[others].view(-1, 2) / tau, dim=1)
        q_global = F.softmax(teacher[others].view(-1, 2) / tau, dim=1)
        return F.cross_entropy(logits, y) + beta * tau**2 * F.kl_div(log_q, q_global, reduction="batchmean")

    return _reference(loss)


def fedlc_reference(tau):
    def loss(p, x, y, x_global, state):  # the authors' form: -log of the calibrated probability of the true class
        calibrated = torch.exp(_mlp(p, x)[1] - tau * state["counts"].double().clamp(min=1e-8).pow(-0.25).float())
        return -torch.log(calibrated.gather(1, y[:, None]) / calibrated.sum(1, keepdim=True)).sum() / len(y)

    return _reference(loss)


def fedrs_reference(alpha):
    def loss(p, x, y, x_global, state):
        logits = _mlp(p, x)[1]
        restricted = torch.stack([logits[:, c] * (1.0 if state["counts"][c] > 0 else alpha) for c in range(3)], dim=1)
        return F.cross_entropy(restricted, y)

    return _reference(loss)


def feddecorr_reference(beta):
    def loss(p, x, y, x_global, state):  # the authors' FedDecorrLoss, transliterated
        z, logits = _mlp(p, x)
        n, d = z.shape
        z = z - z.mean(dim=0, keepdim=True)
        z = z / torch.sqrt(1e-8 + z.var(dim=0, keepdim=True))
        corr = z.t() @ z
        off_diagonal = corr.flatten()[:-1].view(d - 1, d + 1)[:, 1:].flatten()
        return F.cross_entropy(logits, y) + beta * off_diagonal.pow(2).mean() / n

    return _reference(loss)


ALGORITHMS = {  # name: (the algorithm, its reference), at the settings of their configs
    "MOON": (lambda: MOON(mu=1.0, tau=0.5), lambda: moon_reference(1.0, 0.5)),
    "FedNTD": (lambda: FedNTD(beta=1.0, tau=1.0), lambda: fedntd_reference(1.0, 1.0)),
    "FedLC": (lambda: FedLC(tau=1.0), lambda: fedlc_reference(1.0)),
    "FedRS": (lambda: FedRS(alpha=0.5), lambda: fedrs_reference(0.5)),
    "FedDecorr": (lambda: FedDecorr(beta=0.1), lambda: feddecorr_reference(0.1)),
}


@pytest.fixture(scope="module")
def fedavg_ref():
    return fedavg_reference()


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_equals_an_independent_reference(name, execution, fedavg_ref):
    algorithm, reference = ALGORITHMS[name]
    module = _fit(algorithm(), execution)
    if execution == "batched":
        assert not module.executor.inner.fallbacks  # every round ran stacked
    expected = reference()
    difference = _max_difference(module, expected)
    print(f"{name} {execution}: {difference:.2e}")
    assert difference < 2e-6
    assert max(float((expected[k] - fedavg_ref[k]).abs().max()) for k in expected) > 1e-4  # the term matters here


class VmappedMOON(MOON):
    """MOON whose rule runs per client under vmap (it declares no elementwise)."""

    elementwise = False


def test_moon_rule_under_vmap_equals_stacked():
    stacked, vmapped = _fit(MOON(mu=1.0, tau=0.5), "batched"), _fit(VmappedMOON(mu=1.0, tau=0.5), "batched")
    assert not vmapped.executor.inner.fallbacks
    for a, b in zip(stacked.model.parameters(), vmapped.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_moon_on_client_rows_of_a_cnn_equals_sequential():
    """SmallCNN declares independent_rows: the batched forward runs the clients as rows of one batch."""
    from tests.test_execution import _digits

    kw = dict(model_fn=lambda: SmallCNN(channels=4, hidden=16), data_fn=_digits, batch_size=16)
    seq, bat = _fit(MOON(mu=1.0), "sequential", **kw), _fit(MOON(mu=1.0), "batched", **kw)
    assert bat.objective.rows is not None and not bat.executor.inner.fallbacks
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- reductions to FedAvg (bitwise, sequential; to float tolerance, batched) ------------------------
REDUCTIONS = {
    "moon_mu0": lambda: MOON(mu=0.0),
    "fedntd_beta0": lambda: FedNTD(beta=0.0),
    "feddecorr_beta0": lambda: FedDecorr(beta=0.0),
    "fedrs_alpha1": lambda: FedRS(alpha=1.0),
    "fedlc_tau0": lambda: FedLC(tau=0.0),
}


@pytest.fixture(scope="module")
def fedavg():
    return {execution: _params(_fit(FedAvg(), execution, batch_size=16)) for execution in ("sequential", "batched")}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_are_fedavg(fedavg, name):
    for execution in ("sequential", "batched"):
        params = _params(_fit(REDUCTIONS[name](), execution, batch_size=16))
        for k, v in params.items():
            if execution == "sequential":
                assert torch.equal(v, fedavg[execution][k]), (name, k)
            else:
                torch.testing.assert_close(v, fedavg[execution][k], rtol=1e-5, atol=1e-6)


# ---- the contract ---------------------------------------------------------------------------------
def test_loss_terms_are_logged_and_sum_to_the_loss(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), MOON(mu=1.0), LocalTraining(lr=LR, steps=STEPS, batch_size=8))
    tiny_trainer(tmp_path, 3, logger=CSVLogger(tmp_path, name="m", version=0)).fit(module, datamodule=tiny_datamodule())
    with open(tmp_path / "m" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 3
    for row in rows:
        ce, con = float(row["train/loss/ce"]), float(row["train/loss/contrastive"])
        assert math.isclose(ce + con, float(row["train/loss"]), rel_tol=1e-6)
    assert math.isclose(float(rows[0]["train/loss/contrastive"]), math.log(2), rel_tol=1e-6)  # first rounds: previous = global


def test_a_loss_that_reads_features_needs_a_model_with_a_representation():
    from models import SplitLogistic

    with pytest.raises(ValueError, match="MOON reads the model's representation"):
        FederatedModule(SplitLogistic(), MOON())


@pytest.mark.parametrize(
    "model", [MLP(8, 3, hidden=[16]), MLP(8, 3, hidden=[]), SmallCNN(channels=4, hidden=16)], ids=["mlp", "linear", "cnn"]
)
def test_models_forward_is_head_of_representation_bitwise(model):
    x = torch.randn(5, 1, 8, 8) if isinstance(model, SmallCNN) else torch.randn(5, 8)
    assert torch.equal(model(x), model.head(model.representation(x)))


def test_resnet_forward_is_head_of_representation_bitwise():
    from models import ResNet18

    torch.manual_seed(0)
    model, x = ResNet18(num_classes=3, in_channels=1), torch.randn(2, 1, 8, 8)
    z = model.representation(x)
    assert z.shape == (2, 512) and torch.equal(model(x), model.head(z))


CONFIGS = {"moon": ["ce", "contrastive"], "fedntd": ["ce", "ntd"], "fedlc": ["calibrated_ce"], "fedrs": ["restricted_ce"],
           "feddecorr": ["ce", "decorrelation"]}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_fits_through_the_cli_and_logs_its_loss_terms(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", "2", "--model.local.steps", "2"]  # fmt: skip
    if name == "moon":
        args += ["--model.execution", "batched"]
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / f"{name}_digits.yaml"), *args])
    assert type(cli.model.algorithm).__name__.lower() == name and cli.trainer.global_step == 2
    with open(tmp_path / "runs" / f"{name}_digits" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert len(rows) == 2
    for row in rows:
        terms = [float(row[f"train/loss/{term}"]) for term in CONFIGS[name]]
        assert math.isclose(sum(terms), float(row["train/loss"]), rel_tol=1e-6)


def test_ddp_two_processes_equal_one_process_loss_terms_included(tmp_path):
    """MOON split over 2 DDP processes (gloo, CPU; partial sums): the one-process model, client
    store (previous models) and round metrics, train/loss/<term> included."""
    from tests.test_distributed import _assert_close, _train

    single, ddp = _train(tmp_path, 1, "moon", False), _train(tmp_path, 2, "moon", False)
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert ddp["exchanges"]["summed"] == 3
    for name in ("train/loss", "train/loss/ce", "train/loss/contrastive"):
        assert ddp["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5), name


class InterleavingExecutor:
    """Trains the round's clients step by step in turn (client 0's step k, client 1's step k, ...) in
    one process on the one model: a loss with a side channel or shared state would mix them up."""

    def run(self, tasks, info, runtime):
        from fl_lightning.algorithms.base import ClientContext
        from fl_lightning.core.local_loss import client_loss
        from fl_lightning.core.tasks import ClientResult

        algorithm, objective, data, local = runtime.algorithm, runtime.objective, runtime.data, runtime.local
        clients = []
        for task in tasks:
            state = task.load_state().algorithm
            ctx = ClientContext(task.client_id, task.broadcast, state, info, task.num_steps)
            loss = client_loss(algorithm, task.client_id, task.broadcast, state, info, data, runtime.device)
            params = dict(task.broadcast["x"])
            batches = iter(data.client_batches(task.client_id, task.seed, local.batch_size, local.steps))
            clients.append([ctx, loss, params, algorithm.client_init(params, ctx), batches])
        for step in range(local.steps):
            for client in clients:
                ctx, loss, params, local_state, batches = client
                ctx.step, ctx.grad = step, objective.grad_fn(next(batches), local.weight_decay, loss=loss)
                client[2], client[3] = algorithm.client_step(params, local_state, ctx)
        results = []
        for task, (ctx, _, params, local_state, _) in zip(tasks, clients):
            upload, state = algorithm.client_finish(params, local_state, ctx)
            results.append(ClientResult(task.client_id, upload, state, task.num_steps, 0.0))
        return results

    def run_summed(self, tasks, info, runtime):
        return None


def test_clients_interleaving_in_one_process_train_as_one_after_another():
    from fl_lightning.executors import Executor

    class Interleaving(InterleavingExecutor, Executor):
        pass

    for algorithm in (lambda: MOON(mu=1.0), lambda: FedNTD(beta=1.0)):
        sequential, interleaved = _fit(algorithm(), "sequential", rounds=3), _fit(algorithm(), Interleaving(), rounds=3)
        for k, v in _params(sequential).items():
            assert torch.equal(v, _params(interleaved)[k]), k


def test_lora_representation_and_head_give_the_forward(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from models import LoRAClassifier

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    model = LoRAClassifier(str(tmp_path), num_labels=3, rank=2, dropout=0.0)
    ids, mask = torch.randint(1, 50, (4, 6)), torch.ones(4, 6, dtype=torch.long)
    ids[1, 4:], mask[1, 4:] = 0, 0  # a padded sequence: its representation is its last real token's state
    z = model.representation(ids, mask)
    assert z.shape == (4, 16)
    torch.testing.assert_close(model.head(z), model(ids, mask), rtol=1e-5, atol=1e-6)


def test_moon_on_gpt2_lora_runs_batched_as_client_rows_like_sequential(tmp_path_factory, tmp_path):
    """The LoRA classifier's representation (the pooled hidden state) through client rows, the global
    and previous models evaluated per client under vmap: the sequential result."""
    from tests.test_lora_batched import assert_same, fit
    from tests.text_fixtures import shared_assets

    assets = shared_assets(tmp_path_factory)
    seq = fit(assets, tmp_path, lambda: MOON(mu=1.0), "sequential", rounds=2)
    bat = fit(assets, tmp_path, lambda: MOON(mu=1.0), "batched", rounds=2)
    assert bat.objective.rows is not None and not bat.executor.inner.fallbacks
    assert_same(seq, bat)


def test_a_local_loss_falls_back_with_its_reason_when_the_model_cannot_run_under_vmap(tmp_path, caplog):
    import logging

    from tests.test_lora_batched import BranchingMLP

    def run(execution):
        torch.manual_seed(0)
        module = FederatedModule(BranchingMLP(), FedNTD(), LocalTraining(lr=0.1, steps=2, batch_size=8), execution=execution)
        tiny_trainer(tmp_path / execution, rounds=2).fit(module, datamodule=tiny_datamodule())
        return module

    with caplog.at_level(logging.WARNING, logger="fl_lightning.executors.batched"):
        bat = run("batched")
    assert "FedNTD's local_loss runs per client under vmap" in caplog.text
    assert sum(bat.executor.inner.fallbacks.values()) == 2
    seq = run("sequential")
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        assert torch.equal(a, b)


def test_a_loss_that_reads_label_counts_needs_data_that_gives_them(tmp_path):
    from datamodules import FederatedDataModule

    class NoCounts(FederatedDataModule):
        client_label_counts = None

    data = NoCounts(dataset="synthetic", dataset_args={"num_samples": 60, "num_features": 8, "num_classes": 3, "seed": 1}, num_clients=2)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedRS(), LocalTraining(lr=0.1, steps=1, batch_size=8))
    with pytest.raises(ValueError, match="FedRS reads the clients' label counts"):
        tiny_trainer(tmp_path, 1).fit(module, datamodule=data)


def test_client_label_counts_count_the_clients_training_targets():
    data = _data()
    data.setup()
    for client in range(2):
        counts = data.client_label_counts(client)
        assert counts.dtype == torch.int64 and counts.sum() == data.client_sizes[client]
        assert (counts == 0).sum() == 1  # one shard of the label-sorted samples: a class is missing


def test_moon_resumes_bitwise(tmp_path):
    """The previous models are client state: checkpointed, and a resumed run continues bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.conftest import tiny_module

    def run(directory, rounds, ckpt_path=None):
        module = tiny_module(MOON(mu=1.0), LocalTraining(lr=0.1, steps=3, batch_size=8))
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=4, clients_per_round=2), ckpt_path=ckpt_path)
        return module

    assert_resumes_bitwise(run, tmp_path)

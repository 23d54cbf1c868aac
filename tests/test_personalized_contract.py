"""The personalized-FL contract (docs/architecture.md, "Personalized models"): the model each client
predicts with, adaptation at evaluation, a pass over a client's data, a local loss that reads the
parameters being trained, and unseen clients."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.algorithms import FedProx
from fl_lightning.core import params as P
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from fl_lightning.engine.personal_eval import PersonalizedEvaluation
from fl_lightning.executors import BatchedExecutor
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


class KeepsLocalModel(FedAvg):
    """FedAvg whose clients keep the model their local training ended at and predict with it."""

    def client_state_init(self, x):
        return {"own": P.detach_clone(x)}

    def client_finish(self, params, local, ctx):
        upload, _ = super().client_finish(params, local, ctx)
        return upload, {"own": params}

    def personal_model(self, x, client_state, personal):
        return dict(client_state["own"])


class FineTunes(FedAvg):
    """FedAvg whose prediction is the global model after two SGD steps (lr 0.5) on the client's batches."""

    personalize_steps = 2

    def personalize_step(self, params, ctx):
        _, grad = ctx.grad(params)
        return {k: p - 0.5 * grad[k] for k, p in params.items()}



def _stored(store):
    """Every stored client's state, ``{client_id: state}`` (the store's public reads)."""
    return {c: store.get(c, dict) for c in store.client_ids()}

def _fit(tmp_path, algorithm, rounds=3, local=None, **data_kw):
    module = tiny_module(algorithm, local or LocalTraining(lr=0.3, steps=4, batch_size=8))
    data = tiny_datamodule(num_clients=8, clients_per_round=3, holdout_fraction=0.3, **data_kw)
    trainer = tiny_trainer(tmp_path, rounds=rounds, limit_val_batches=None, val_check_interval=rounds, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=data)
    return module, data, trainer


def _accuracy(model, params, batch) -> float:
    inputs, target = batch
    with torch.no_grad():
        logits = functional_call(model, params, (inputs,))
    return float((logits.argmax(-1) == target).double().mean())


def test_evaluation_scores_each_client_with_the_model_it_predicts_with(tmp_path):
    module, data, trainer = _fit(tmp_path, KeepsLocalModel(), rounds=4)
    x = {k: v.detach() for k, v in module.model.named_parameters()}
    own, glob = [], []
    for cid in range(data.num_clients):
        batch = data.client_holdout_batch(cid, "validation")
        own.append(_accuracy(module.model, module.store.get(cid, lambda: {"own": x})["own"], batch))
        glob.append(_accuracy(module.model, x, batch))
    metrics = trainer.callback_metrics
    assert float(metrics["val/personal_acc_mean"]) == pytest.approx(sum(own) / len(own), abs=1e-6)
    # the test can tell the two apart: scored with the global model, the mean would differ
    assert sum(abs(a - b) for a, b in zip(own, glob)) / len(own) > 0.02  # per client
    sizes = torch.tensor([len(data.client_holdout_part(c, "validation")) for c in range(data.num_clients)], dtype=torch.float64)
    weighted = float((torch.tensor(own, dtype=torch.float64) * sizes).sum() / sizes.sum())
    assert float(metrics["val/personal_acc_weighted"]) == pytest.approx(weighted, abs=1e-6)


def test_fedavg_clients_predict_with_the_global_model(tmp_path):
    module, data, trainer = _fit(tmp_path, FedAvg())
    x = {k: v.detach() for k, v in module.model.named_parameters()}
    accs = [_accuracy(module.model, x, data.client_holdout_batch(c, "validation")) for c in range(data.num_clients)]
    assert float(trainer.callback_metrics["val/personal_acc_mean"]) == pytest.approx(sum(accs) / len(accs), abs=1e-6)


def test_personalize_step_adapts_the_prediction_from_the_clients_training_batches(tmp_path):
    module, data, _ = _fit(tmp_path, FineTunes())
    x = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    cid = 2
    seed = derive_seed(data.seed, cid, PERSONALIZE_STREAM)
    torch.manual_seed(seed)
    params = x
    for batch in list(data.client_batches(cid, seed, 8, 2))[:2]:  # reference: two plain SGD steps
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(module.model, leaves, (batch[0],)), batch[1])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        params = {k: v.detach() - 0.5 * g for (k, v), g in zip(leaves.items(), grads)}
    got = module.prediction_params(cid)
    for k in params:
        torch.testing.assert_close(got[k], params[k], rtol=0, atol=1e-6)
    assert any(not torch.equal(got[k], x[k]) for k in x)  # it did adapt


def test_unseen_clients_are_drawn_by_the_seed_and_never_train(tmp_path):
    module, data, _ = _fit(tmp_path, KeepsLocalModel(), rounds=6, new_client_fraction=0.25)
    assert data.num_clients == 6 and data.unseen_clients == [6, 7]
    assert sorted(data.partition_ids.tolist()) == list(range(8))
    assert len(data.client_sizes) == 6
    trained = set(module.store.client_ids())
    assert trained and trained <= set(range(6))
    again = tiny_datamodule(num_clients=8, clients_per_round=3, holdout_fraction=0.3, new_client_fraction=0.25)
    again.setup()
    assert torch.equal(again.partition_ids, data.partition_ids)
    other = tiny_datamodule(num_clients=8, clients_per_round=3, holdout_fraction=0.3, new_client_fraction=0.25, seed=5)
    other.setup()
    assert other.num_clients == 6


def test_an_unseen_client_runs_one_local_round_of_the_algorithm_then_predicts(tmp_path):
    local = LocalTraining(lr=0.3, steps=4, batch_size=8)
    module, data, trainer = _fit(tmp_path, KeepsLocalModel(), rounds=3, local=local, new_client_fraction=0.25)
    cid = data.unseen_clients[0]
    x = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    seed = derive_seed(data.seed, cid, 2, PERSONALIZE_STREAM)  # the last completed round: 2
    params = x
    for batch in data.client_batches(cid, seed, 8, 4):  # reference: K = 4 plain SGD steps from the global model
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(module.model, leaves, (batch[0],)), batch[1])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        params = {k: v.detach() - 0.3 * g for (k, v), g in zip(leaves.items(), grads)}
    got = module.unseen_prediction_params(cid)
    for k in params:
        torch.testing.assert_close(got[k], params[k], rtol=0, atol=1e-6)
    accs = [_accuracy(module.model, module.unseen_prediction_params(c), data.client_holdout_batch(c, "validation")) for c in data.unseen_clients]
    assert float(trainer.callback_metrics["val/unseen_acc_mean"]) == pytest.approx(sum(accs) / len(accs), abs=1e-6)
    assert cid not in set(module.store.client_ids())  # nothing of the unseen client is stored


class ProxAsLoss(FedAvg):
    """FedProx's objective written as a local loss: CE + mu/2 ||w - x||^2 (reads ctx.params)."""

    elementwise = True

    def local_loss(self, out, target, ctx):
        prox = sum(((ctx.params[k] - ctx.broadcast["x"][k]) ** 2).sum() for k in ctx.broadcast["x"])
        return {"ce": F.cross_entropy(out.logits, target), "prox": 0.5 * 0.7 * prox}


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_a_local_loss_reads_the_parameters_being_trained(tmp_path, execution):
    runs = {}
    for name, algorithm in {"loss": ProxAsLoss(), "rule": FedProx(mu=0.7)}.items():
        module = tiny_module(algorithm, LocalTraining(lr=0.2, steps=3, batch_size=8))
        if execution == "batched":
            module.executor.inner = BatchedExecutor()
        tiny_trainer(tmp_path / name, rounds=3).fit(module, datamodule=tiny_datamodule())
        assert not getattr(module.executor.inner, "fallbacks", None)  # stacked, not sequential
        runs[name] = module
    for a, b in zip(runs["loss"].model.parameters(), runs["rule"].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class MeanFeature(FedAvg):
    """Keeps the mean representation of its training set per class, from a pass over its data."""

    def client_state_init(self, x):
        return {"means": {"z": torch.zeros(3, 16)}, "own": P.detach_clone(x)}

    def client_finish(self, params, local, ctx):
        upload, _ = super().client_finish(params, local, ctx)
        seen = ctx.data_pass(params)
        onehot = F.one_hot(seen.target, 3).to(seen.features.dtype) * seen.mask[:, None]
        return upload, {"means": {"z": onehot.T @ seen.features / onehot.sum(0).clamp(min=1)[:, None]}, "own": params}


def test_a_data_pass_reads_the_clients_whole_training_set(tmp_path):
    module, data, _ = _fit(tmp_path, MeanFeature(), rounds=1)
    for cid in module.store.client_ids():
        state = module.store.get(cid, dict)
        inputs, target = data.client_full_batch(cid)
        with torch.no_grad():  # reference: the representation at the client's final parameters, averaged per class by hand
            saved = {k: v.detach().clone() for k, v in module.model.named_parameters()}
            module.model.load_state_dict(state["own"], strict=False)
            z = module.model.representation(inputs)
            module.model.load_state_dict(saved, strict=False)
        for c in range(3):
            rows = z[target == c]
            expected = rows.mean(0) if len(rows) else torch.zeros(z.shape[1])
            torch.testing.assert_close(state["means"]["z"][c], expected, rtol=1e-5, atol=1e-6)


def test_an_unseen_client_counts_its_epochs_over_its_own_training_split(tmp_path):
    """K for an unseen client is E * ceil(n_i / B) of its own split: it is not among the training
    clients' sizes, and asking those for it once raised IndexError."""
    local = LocalTraining(lr=0.3, steps=None, epochs=1, batch_size=8)
    module, data, _ = _fit(tmp_path, KeepsLocalModel(), rounds=2, local=local, new_client_fraction=0.25)
    cid = data.unseen_clients[-1]
    n = len(data.client_train[cid])
    assert data.num_local_steps(cid, 8, None, 2) == 2 * -(-n // 8)
    assert data.num_local_steps(cid, 8, 5, None) == 5
    got = module.unseen_prediction_params(cid)
    assert set(got) == {k for k, _ in module.model.named_parameters()}


def test_unseen_client_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"new_client_fraction=0.2 needs data.holdout_fraction"):
        tiny_datamodule(new_client_fraction=0.2)
    with pytest.raises(ValueError, match=r"data.new_client_fraction must be in \[0, 1\), got 1.5"):
        tiny_datamodule(holdout_fraction=0.2, new_client_fraction=1.5)
    with pytest.raises(ValueError, match="leaves no client to train"):
        tiny_datamodule(num_clients=2, holdout_fraction=0.2, new_client_fraction=0.9)


def test_every_run_with_a_holdout_scores_personalized_models_once(tmp_path):
    module = tiny_module(FedAvg())
    data = tiny_datamodule(holdout_fraction=0.3)
    trainer = tiny_trainer(tmp_path, rounds=2, limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None,
                           callbacks=[PersonalizedEvaluation()])
    trainer.fit(module, datamodule=data)
    assert sum(isinstance(c, PersonalizedEvaluation) for c in trainer.callbacks) == 1
    assert "val/personal_acc_worst10" in trainer.callback_metrics


def test_a_data_pass_in_client_finish_runs_stacked_and_equals_sequential(tmp_path):
    stores = {}
    for name, executor in {"seq": "sequential", "bat": BatchedExecutor()}.items():
        module = tiny_module(MeanFeature(), LocalTraining(lr=0.3, steps=4, batch_size=8))
        module.executor.inner = module.executor.inner if executor == "sequential" else executor
        tiny_trainer(tmp_path / name, rounds=2).fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3))
        stores[name] = module.store
        if name == "bat":
            assert not module.executor.inner.fallbacks  # the clients trained stacked; only the pass ran per client
    for cid, state in _stored(stores["seq"]).items():
        torch.testing.assert_close(_stored(stores["bat"])[cid]["means"]["z"], state["means"]["z"], rtol=1e-5, atol=1e-6)


def test_the_result_line_names_the_personalized_and_unseen_numbers():
    from fl_lightning.run.terminal import RunSummary

    summary = RunSummary()
    summary.name, summary.rounds, summary.accuracies, summary.test_acc = "Ditto", 10, [(10, 0.5)], 0.45
    assert "per-client" not in summary.line()  # a run without a held-out split reports none
    summary.personal = {"personal_acc_mean": 0.8125, "personal_acc_worst10": 0.25, "unseen_acc_mean": 0.75}
    line = summary.line()
    assert "test acc 0.4500 (final model)" in line
    assert ("per-client acc 0.8125 (the model each client predicts with, on the validation half of its held-out data, mean; "
            "worst 10% 0.2500; per client at every evaluation: clients.csv)") in line  # fmt: skip
    assert "unseen clients 0.7500" in line


@pytest.mark.parametrize("make", ["Ditto", "APFL", "PerFedAvg"])
def test_personalized_methods_with_a_fedavg_upload_compose_with_privacy_and_compression(tmp_path, make):
    """A personal model never leaves the client, so client-level DP (clip, noise) and compression act on the
    FedAvg delta alone: with clip_norm huge, no noise and identity compression the run equals the plain run."""
    from fl_lightning import algorithms as A
    from fl_lightning.compression import Compression
    from fl_lightning.pipeline.privacy import ClientPrivacy

    runs = {}
    for name, kw in {"plain": {}, "private": {"privacy": ClientPrivacy(clip_norm=1e9, noise_multiplier=0.0)},
                     "compressed": {"compression": Compression()}}.items():  # fmt: skip
        torch.manual_seed(0)
        module = tiny_module(getattr(A, make)())
        module = type(module)(module.model, getattr(A, make)(), module.local, **kw)
        data = tiny_datamodule(num_clients=6, clients_per_round=3, holdout_fraction=0.3)
        tiny_trainer(tmp_path / name, rounds=2, limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None).fit(
            module, datamodule=data
        )
        runs[name] = module
    for other in ("private", "compressed"):
        for a, b in zip(runs["plain"].model.parameters(), runs[other].model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for cid in runs["plain"].store.client_ids():
            state = {k: v for k, v in runs[other].store.get(cid, dict).items() if not k.startswith("msg:")}
            for name, td in runs["plain"].store.get(cid, dict).items():
                for k, v in td.items():
                    torch.testing.assert_close(state[name][k], v, rtol=1e-6, atol=1e-7)

"""FedBABU (Oh, Kim & Yun, ICLR 2022; docs/algorithms.md, 25.8): the head frozen at its initialisation during
training, fine-tuning at evaluation; against an independent plain-PyTorch FedBABU."""

import pytest
import torch

from fl_lightning import FedAvg
from fl_lightning.algorithms import FedBABU
from fl_lightning.core.participation import derive_seed
from fl_lightning.engine.prediction import PERSONALIZE_STREAM
from tests.pfl_reference import (
    BATCH, LR, ROUNDS, STEPS, assert_personal_metrics, cnn, data, fit, fit_config, grads, max_difference, record_uploads, shared_params,
)  # fmt: skip

HEAD = ["classifier.2.weight", "classifier.2.bias"]  # the last layer: the default head


def reference_fedbabu(finetune, finetune_steps, finetune_lr):
    """Training: local SGD on the body only (the head as initialised), FedAvg's server. Evaluation: client c
    fine-tunes the global model (``finetune``: all tensors or the head) by ``finetune_steps`` SGD steps on the
    batches of its personalization seed; an unseen client the same (its local round changes nothing it keeps)."""
    d = data()
    d.setup()
    model = cnn()
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    for t in range(ROUNDS):
        plan = d.participation.plan(t, d.client_sizes, d.seed)
        new_x = dict(x)
        for cid, seed, w in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            p = dict(x)
            for inputs, target in d.client_batches(cid, seed, BATCH, STEPS):
                g = grads(model, p, inputs, target)
                p = {n: p[n] if n in HEAD else p[n] - LR * g[n] for n in p}
            new_x = {n: new_x[n] + w * (p[n] - x[n]) for n in x}
        x = new_x

    def predict(cid):
        p = dict(x)
        for inputs, target in d.client_batches(cid, derive_seed(d.seed, cid, PERSONALIZE_STREAM), BATCH, finetune_steps):
            g = grads(model, p, inputs, target)
            p = {n: p[n] - finetune_lr * g[n] if finetune == "all" or n in HEAD else p[n] for n in p}
        return p

    return x, predict, d.unseen_clients


@pytest.mark.parametrize("finetune,finetune_lr", [("all", None), ("head", 0.3)])
def test_fedbabu_equals_an_independent_reference(finetune, finetune_lr):
    module = fit(FedBABU(finetune=finetune, finetune_steps=3, finetune_lr=finetune_lr))
    x, predict, unseen = reference_fedbabu(finetune, 3, finetune_lr or LR)
    training = max_difference(shared_params(module), x)
    predicted = max(max_difference(module.prediction_params(c), predict(c)) for c in range(module.datamodule.num_clients))
    unseen_difference = max_difference(module.unseen_prediction_params(unseen[0]), predict(unseen[0]))
    print(f"FedBABU finetune={finetune} vs reference: global {training:.2e}, predict {predicted:.2e}, unseen {unseen_difference:.2e}")
    assert max(training, predicted, unseen_difference) < 1e-6
    tuned = {n: v for n, v in predict(0).items() if finetune == "all" or n in HEAD}
    assert max_difference(tuned, {n: x[n] for n in tuned}) > 1e-3  # predicting with the global model would fail above


def test_the_head_stays_at_its_initialisation_and_its_deltas_are_zero():
    algorithm = FedBABU()
    uploads = record_uploads(algorithm)
    module = fit(algorithm)
    initial = cnn()
    for name in HEAD:
        assert torch.equal(module.model.get_parameter(name).detach(), initial.get_parameter(name).detach())
        assert all(torch.equal(u["delta"][name], torch.zeros_like(u["delta"][name])) for u in uploads)
    assert any(float(u["delta"]["features.0.weight"].abs().max()) > 0 for u in uploads)


def test_without_fine_tuning_it_is_fedavg_with_the_head_frozen():
    """finetune_steps = 0: FedAvg on a model whose head does not train (requires_grad False), bit for bit,
    and every client predicts with the global model."""

    def frozen_head():
        model = cnn()
        model.classifier[2].requires_grad_(False)
        return model

    babu, fedavg = fit(FedBABU(finetune_steps=0)), fit(FedAvg(), model_fn=frozen_head)
    assert fedavg.federated_names == [n for n in babu.federated_names if n not in HEAD]
    for name, value in fedavg.model.named_parameters():
        assert torch.equal(value.detach(), babu.model.get_parameter(name).detach()), name
    global_params = shared_params(babu)
    assert all(max_difference(babu.prediction_params(c), global_params) == 0.0 for c in range(3))


def test_batched_equals_sequential():
    """No personal tensors: the clients run stacked (no fallback); fine-tuning at evaluation is per client either way."""
    seq, bat = fit(FedBABU(), execution="sequential"), fit(FedBABU(), execution="batched")
    assert not bat.executor.inner.fallbacks and bat.objective.rows is not None
    difference = max_difference(shared_params(seq), shared_params(bat))
    predicted = max_difference(seq.prediction_params(0), bat.prediction_params(0))
    print(f"FedBABU batched vs sequential: global {difference:.2e}, predict {predicted:.2e}")
    assert difference < 1e-6 and predicted < 1e-5
    for name in HEAD:
        assert torch.equal(bat.model.get_parameter(name), seq.model.get_parameter(name))


def test_bad_settings_are_refused_in_one_line():
    for kw, message in [({"finetune": "body"}, "FedBABU finetune must be 'all' or 'head', got 'body'"),
                        ({"finetune_steps": -1}, "FedBABU finetune_steps must be an integer >= 0, got -1"),
                        ({"finetune_lr": 0.0}, "FedBABU finetune_lr must be > 0"),
                        ({"head": []}, "FedBABU head must be a non-empty list")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            FedBABU(**kw)
    with pytest.raises(ValueError, match="FedBABU head \\['fc'\\] must match some but not all of the federated tensors"):
        fit(FedBABU(head=["fc"]), rounds=1)
    with pytest.raises(ValueError, match="FedBABU head \\['\\*'\\] must match some but not all"):
        fit(FedBABU(head=["*"]), rounds=1)


def test_the_config_fits_through_the_cli_and_logs_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_fedbabu_digits")
    algorithm = cli.model.algorithm
    assert type(algorithm) is FedBABU and (algorithm.finetune, algorithm.personalize_steps) == ("all", 5)
    assert_personal_metrics(rows)


def test_the_default_head_is_the_models_last_layer():
    from fl_lightning.algorithms.fedbabu import head_names
    from models import MLP

    assert head_names(dict(cnn().named_parameters()), None) == HEAD
    assert head_names(dict(MLP(8, 3, hidden=[16]).named_parameters()), None) == ["net.3.weight", "net.3.bias"]
    assert head_names(dict(cnn().named_parameters()), ["classifier.2"]) == HEAD

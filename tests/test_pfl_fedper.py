"""FedPer (Arivazhagan et al. 2019) = FedSim with the head personal (docs/algorithms.md, 25.7):
configs/pfl_fedper_digits.yaml against an independent plain-PyTorch FedPer."""

import torch

from fl_lightning.algorithms import FedSim
from fl_lightning.commands.cli import build_cli
from tests.pfl_reference import (
    ROOT, ROUNDS, assert_personal_metrics, batched_equals_sequential, compare_partial, fit, fit_config, record_uploads,
)  # fmt: skip

HEAD = ["classifier.2"]


def test_the_config_is_fedsim_with_the_smallcnn_head_personal():
    cli = build_cli(["--config", str(ROOT / "configs" / "pfl_fedper_digits.yaml")], run=False)
    assert type(cli.model.algorithm) is FedSim
    assert cli.model.personal_names == ["classifier.2.weight", "classifier.2.bias"]
    assert cli.model.federated_names == ["features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias",
                                         "classifier.0.weight", "classifier.0.bias"]  # fmt: skip


def test_fedper_equals_an_independent_reference():
    """Global body, each client's head, the parameters each training client and the unseen client predict with."""
    differences = compare_partial(FedSim(), HEAD)
    print("FedPer vs reference:", differences)
    assert max(v for k, v in differences.items() if k != "personal_moved") < 1e-6
    assert differences["personal_moved"] > 1e-3  # the heads moved: predicting with the global head would fail above


def test_the_head_never_leaves_the_client():
    algorithm = FedSim()
    uploads = record_uploads(algorithm)
    module = fit(algorithm, HEAD)
    assert len(uploads) == 3 * ROUNDS
    assert all(set(u) == {"delta"} and set(u["delta"]) == set(module.federated_names) for u in uploads)
    assert not any(k.startswith("classifier.2") for u in uploads for k in u["delta"])
    head = module.model.classifier[2].weight.detach()
    assert torch.equal(head, fit(FedSim(), HEAD, rounds=1).model.classifier[2].weight.detach())  # the template never moves


def test_batched_execution_stacks_the_clients_and_equals_sequential_execution():
    batched_equals_sequential(FedSim, HEAD)


def test_the_config_fits_through_the_cli_and_logs_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_fedper_digits")
    assert cli.trainer.global_step == 3
    assert_personal_metrics(rows)


def test_the_config_run_is_the_base_protocol_run_with_fedsim_and_the_head_personal(tmp_path, monkeypatch):
    """fl-lightning fit of pfl_fedper_digits.yaml = fit of pfl_digits.yaml (FedAvg) told FedSim and personal
    [classifier.2] on the command line: the same model and client store, bit for bit."""
    fedper, _ = fit_config(tmp_path / "a", monkeypatch, "pfl_fedper_digits")
    told, _ = fit_config(tmp_path / "b", monkeypatch, "pfl_digits", "--model.algorithm", "fl_lightning.algorithms.FedSim",
                         "--model.personal", "[classifier.2]")  # fmt: skip
    for a, b in zip(fedper.model.model.parameters(), told.model.model.parameters()):
        assert torch.equal(a, b)
    assert len(fedper.model.store) >= 5 and fedper.model.store.equal(told.model.store)

"""LG-FedAvg (Liang et al. 2020) = FedSim with the representation personal and the head global
(docs/algorithms.md, 25.7): configs/pfl_lgfedavg_digits.yaml against an independent LG-FedAvg."""

from fl_lightning.algorithms import FedSim
from fl_lightning.commands.cli import build_cli
from tests.pfl_reference import (
    ROOT, assert_personal_metrics, batched_equals_sequential, compare_partial, fit, fit_config, record_uploads,
)  # fmt: skip

BODY = ["features", "classifier.0"]


def test_the_config_keeps_every_layer_but_the_head_personal():
    cli = build_cli(["--config", str(ROOT / "configs" / "pfl_lgfedavg_digits.yaml")], run=False)
    assert type(cli.model.algorithm) is FedSim
    assert cli.model.federated_names == ["classifier.2.weight", "classifier.2.bias"]
    assert cli.model.personal_names == ["features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias",
                                        "classifier.0.weight", "classifier.0.bias"]  # fmt: skip


def test_lgfedavg_equals_an_independent_reference():
    """Global head, each client's body, the parameters each training client and the unseen client predict with."""
    differences = compare_partial(FedSim(), BODY)
    print("LG-FedAvg vs reference:", differences)
    assert max(v for k, v in differences.items() if k != "personal_moved") < 1e-6
    assert differences["personal_moved"] > 1e-3  # the bodies moved: predicting with the initial body would fail above


def test_only_the_head_is_uploaded():
    algorithm = FedSim()
    uploads = record_uploads(algorithm)
    fit(algorithm, BODY)
    assert uploads and all(set(u["delta"]) == {"classifier.2.weight", "classifier.2.bias"} for u in uploads)


def test_batched_execution_stacks_the_clients_and_equals_sequential_execution():
    batched_equals_sequential(FedSim, BODY)


def test_the_config_fits_through_the_cli_and_logs_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_lgfedavg_digits")
    assert cli.trainer.global_step == 3
    assert_personal_metrics(rows)

"""A validation split held out from the clients' training data, distinct from the test set."""

from __future__ import annotations

import csv

import pytest
import torch

from datamodules import IID, FederatedDataModule
from fl_lightning.experiments.history import History
from tests.conftest import tiny_datamodule
from tests.test_cli import ROOT, fl_lightning


def test_the_validation_split_comes_out_of_each_clients_training_data():
    plain, split = tiny_datamodule(), tiny_datamodule(val_fraction=0.25)
    plain.setup(), split.setup()
    validation = set(split.validation_indices.tolist())
    for cid in range(plain.num_clients):
        before, after = set(plain.client_train[cid].tolist()), set(split.client_train[cid].tolist())
        held = before - after
        assert after < before and held <= validation and len(held) == int(0.25 * len(before))
    assert not validation & set(torch.cat(list(split.client_train)).tolist())
    validation_loader, test_loader = split.val_dataloader()  # the split, then the test set
    assert len(validation_loader.dataset) == len(validation) and test_loader.dataset is split.source.test
    assert not isinstance(plain.val_dataloader(), list)  # without a split, val is the test set (as before)


def test_val_fraction_is_checked_against_holdout_fraction():
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1 - holdout_fraction\) = \[0, 0.5\), got 0.6"):
        FederatedDataModule("digits", holdout_fraction=0.5, val_fraction=0.6)


def test_every_evaluation_logs_validation_and_test_from_the_cli(tmp_path):
    config = str(ROOT / "configs" / "quickstart.yaml")
    fl_lightning("fit", "--config", config, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                 "--data.init_args.val_fraction", "0.2", cwd=tmp_path)  # fmt: skip
    with open(tmp_path / "runs" / "quickstart" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluations = [r for r in rows if r.get("val/acc")]
    assert len(evaluations) == 2 and all(r["test/acc"] and r["val/acc"] != r["test/acc"] for r in evaluations)
    final_test = [r for r in rows if r.get("test/acc") and not r.get("val/acc")]  # fit ends with a test of the final model
    assert len(final_test) == 1 and final_test[0]["test/acc"] == evaluations[-1]["test/acc"]


def test_the_selected_accuracy_is_the_test_accuracy_at_the_best_validation():
    history = History([{"round": 1, "val/acc": 0.5, "test/acc": 0.4}, {"round": 2, "val/acc": 0.7, "test/acc": 0.6},
                       {"round": 3, "val/acc": 0.6, "test/acc": 0.9}])  # fmt: skip
    assert history.at_best("val/acc", "test/acc") == 0.6  # not the best test accuracy (0.9)


def test_a_validation_split_that_holds_out_no_sample_is_refused_before_training():
    """floor(0.1 * size) is 0 for clients of fewer than 10 samples: val/acc would never be logged."""
    data = tiny_datamodule(num_clients=60, val_fraction=0.1, partition=IID())  # 300 samples: about 5 a client
    with pytest.raises(ValueError, match=r"^val_fraction=0.1 holds out no sample: .* the largest client has \d+; set val_fraction >= 0\.\d+"):
        data.setup()


def test_the_suggested_val_fraction_holds_out_samples():
    data = tiny_datamodule(num_clients=60, val_fraction=0.1, partition=IID())
    with pytest.raises(ValueError) as refused:
        data.setup()
    suggested = float(str(refused.value).split(">= ")[1].split(" ")[0])
    data = tiny_datamodule(num_clients=60, val_fraction=suggested, partition=IID())
    data.setup()
    assert len(data.validation_indices) > 0

"""Bad settings fail before training with the setting's name and allowed range."""

from pathlib import Path

import pytest

from datamodules import IID, Dirichlet, FederatedDataModule
from fl_lightning import FedAvg, LocalTraining, UniformSampling
from fl_lightning.commands.cli import build_cli
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: tiny_datamodule(num_clients=4, clients_per_round=5), "clients_per_round=5 exceeds num_clients=4"),
        (lambda: UniformSampling(0), "clients_per_round must be >= 1"),
        (lambda: UniformSampling(1.5), "fraction must be in \\(0, 1\\]"),
        (lambda: LocalTraining(lr=0.0), "local.lr must be > 0"),
        (lambda: LocalTraining(lr=-1.0), "local.lr must be > 0"),
        (lambda: LocalTraining(steps=0), "local.steps must be >= 1"),
        (lambda: LocalTraining(steps=None, epochs=0), "local.epochs must be >= 1"),
        (lambda: LocalTraining(steps=3, epochs=2), "exactly one of local.steps and local.epochs"),
        (lambda: LocalTraining(batch_size=0), "local.batch_size must be >= 1"),
        (lambda: LocalTraining(lr_decay=1.5), "local.lr_decay must be in \\(0, 1\\]"),
        (lambda: FedAvg(global_lr=0.0), "global_lr must be > 0"),
        (lambda: Dirichlet(alpha=0.0), "alpha must be > 0"),
        (lambda: FederatedDataModule(dataset="no-such-data"), "unknown dataset 'no-such-data'"),
        (lambda: FederatedDataModule(num_clients=0), "num_clients must be >= 1"),
    ],
)
def test_invalid_settings_are_rejected_with_their_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "data, message",
    [
        (lambda: tiny_datamodule(num_clients=60, clients_per_round=2, partition=Dirichlet(0.5, min_size=5)), "need num_clients \\* min_size <= 240"),
        (lambda: tiny_datamodule(num_clients=300, clients_per_round=2, partition=IID()), "left 60 of num_clients=300 clients empty"),
    ],
)
def test_impossible_partitions_fail_before_training(tmp_path, data, message):
    module = tiny_module()
    with pytest.raises(ValueError, match=message):
        tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=data())
    assert module.trainer.global_step == 0


@pytest.mark.parametrize("rounds", [0, -1])
def test_non_positive_rounds_are_rejected(tmp_path, rounds):
    with pytest.raises(ValueError, match="max_steps is the number of rounds and must be >= 1"):
        tiny_trainer(tmp_path, rounds=rounds).fit(tiny_module(), datamodule=tiny_datamodule())


@pytest.mark.parametrize(
    "flag, value",
    [("--model.algorithm", "NoSuchAlgorithm"), ("--model.model", "models.NoSuchModel")],
)
def test_unknown_algorithm_or_model_names_are_rejected_by_the_cli(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_cli(["--config", str(ROOT / "configs" / "quickstart.yaml"), flag, value], run=False)
    err = capsys.readouterr().err
    assert value in err and flag.lstrip("-").split(".")[-1] in err


def test_short_algorithm_names_resolve_in_the_cli():
    cli = build_cli(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.algorithm", "FedAvg"], run=False)
    assert isinstance(cli.model.algorithm, FedAvg)

"""The lora_<method> configs (docs/lora.md, docs/algorithms.md 28) parse, and one runs through the CLI on offline fixtures."""

from __future__ import annotations

import functools

import io
from pathlib import Path

import pytest
import torch

from fl_lightning.commands.cli import build_cli
from fl_lightning.lora import METHODS
from tests.test_lora_cli import assets, offline  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("lora_*.yaml"))

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("name", CONFIGS)
def test_lora_configs_compose_on_fedit_sst2_and_name_their_method(assets, name):
    files = {"train": assets.sst2["train"], "validation": assets.sst2["validation"], "test": assets.sst2["validation"]}
    module = build_cli(["--config", str(ROOT / "configs" / f"{name}.yaml"), *offline(assets, files)], run=False).model
    method = name.removeprefix("lora_").split("_gpt2")[0]
    assert module.lora.method.name == method and type(module.lora.method) is METHODS[method]
    assert module.lora.method.ranks == ([2, 4, 8] if name.endswith("_hetero") else None)
    assert len(CONFIGS) == 11


def test_a_heterogeneous_flora_config_runs_through_the_cli_and_logs_the_folded_bytes(assets, tmp_path, monkeypatch):
    args = [
        "--config", str(ROOT / "configs" / "lora_stacked_gpt2_sst2_hetero.yaml"), *offline(assets, assets.sst2),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.accelerator", "cpu",
        "--data.init_args.num_clients", "3", "--data.init_args.partition.init_args.alpha", "1.0",
        "--data.init_args.participation.init_args.clients_per_round", "3", "--data.init_args.max_length", "32",
        "--model.local.steps", "2", "--model.local.epochs", "null", "--model.local.batch_size", "8",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cli = build_cli(args, run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "runs" / "lora_stacked_gpt2_sst2_hetero"
    rows = (run / "version_0" / "metrics.csv").read_text()
    assert "comm/round_bytes_fold" in rows and "val/acc" in rows
    import csv

    trained = [r for r in csv.DictReader(io.StringIO(rows)) if r.get("comm/round_bytes_fold")]
    broadcast = sum(t.numel() * t.element_size() for t in cli.model.global_params().values())  # factors; x only (FedAvg)
    total = 0.0
    for row in trained:  # the fold is sent to every client beside the broadcast, and counted in the totals
        fold, clients = float(row["comm/round_bytes_fold"]), float(row["train/clients"])
        assert fold > 0 and float(row["comm/round_bytes_down"]) == (broadcast + fold) * clients
        total += float(row["comm/round_bytes_down"]) + float(row["comm/round_bytes_up"])
    assert float(trained[-1]["comm/cumulative_bytes"]) == total
    assert (run / "version_0" / "adapter" / "base" / "config.json").is_file()  # in the run's own folder
    assert not (run / "adapter").exists()


def test_an_unknown_method_is_refused_before_lightning_is_imported():
    """The early check names the method list the module's own check names (one table, checked to agree)."""
    from fl_lightning.run.config_files import expand_bases
    from fl_lightning.run.setting_check import check_all
    from fl_lightning.run.setting_ranges import LORA_METHODS

    assert tuple(METHODS) == LORA_METHODS
    quickstart = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    lines = check_all(expand_bases(["fit", "--config", quickstart, "--model.lora_aggregation", "svdd"]), None)
    assert lines == [f"model.lora_aggregation must be one of {', '.join(METHODS)}, got 'svdd'"]
    assert check_all(expand_bases(["fit", "--config", quickstart, "--model.lora_aggregation", "share_a"]), None) == []


def _refused_before_the_trainer(monkeypatch, capsys, args: list[str]) -> list[str]:
    """The command's error lines; fails if Lightning's Trainer was built (its start-up) before the refusal."""
    from lightning.pytorch import Trainer

    from fl_lightning.commands.cli import main

    @functools.wraps(Trainer.__init__)  # the parser reads the trainer's settings from this signature
    def no_trainer(*a, **k):
        raise AssertionError("the Trainer was built: the rule was checked after Lightning's start-up")

    monkeypatch.setattr(Trainer, "__init__", no_trainer)
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_rank_above_the_models_is_refused_before_the_trainer_is_built(assets, monkeypatch, capsys):
    args = ["fit", "--config", str(ROOT / "configs" / "lora_stacked_gpt2_sst2_hetero.yaml"), *offline(assets, assets.sst2),
            "--model.lora_aggregation.init_args.ranks", "[2, 99]"]  # fmt: skip
    lines = _refused_before_the_trainer(monkeypatch, capsys, args)
    assert lines == ["fl-lightning: error: model.lora_aggregation ranks must be in [1, 8] (the model's rank), got [2, 99]"]

"""The shipped FedIT configs parse, and one runs end to end through the CLI parser on offline fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from datamodules import TextDataModule
from fl_lightning.commands.cli import build_cli
from fl_lightning.run.export import ExportPretrained
from models import LoRAClassifier
from tests.text_fixtures import Assets, shared_assets

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["fedit_gpt2_sst2", "fedit_gpt2_20news", "fedit_gpt2_qqp", "fedit_gpt2_qnli"]
PAPER = {  # (eta_l, eta_g, classes, task) from Table C.1 of Chen et al. 2025 (arXiv:2502.02727)
    "fedit_gpt2_sst2": (1e-3, 0.3, 2, "sst2"),
    "fedit_gpt2_20news": (5e-3, 0.1, 20, "20news"),
    "fedit_gpt2_qqp": (1e-4, 0.3, 2, "qqp"),
    "fedit_gpt2_qnli": (3e-5, 0.3, 2, "qnli"),
}

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


def offline(assets: Assets, files: dict[str, str]) -> list[str]:
    return [
        "--model.model.init_args.model_name_or_path", str(assets.gpt2),
        "--data.init_args.tokenizer", str(assets.tokenizer),
        "--data.init_args.data_files", json.dumps(files),
        "--data.init_args.cache_dir", str(assets.cache),
    ]  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_fedit_configs_hold_the_paper_settings(assets, name):
    lr_l, lr_g, classes, task = PAPER[name]
    files = {"train": assets.sst2["train"], "validation": assets.sst2["validation"], "test": assets.sst2["validation"]}
    cli = build_cli(["--config", str(ROOT / "configs" / f"{name}.yaml"), *offline(assets, files)], run=False)
    module, data = cli.model, cli.datamodule
    assert isinstance(module.model, LoRAClassifier) and module.model.num_labels == classes
    assert isinstance(data, TextDataModule) and data.task == task
    assert module.local.lr == lr_l and module.local.epochs == 1 and module.local.weight_decay == 1e-8
    assert module.algorithm.global_lr == lr_g and type(module.algorithm).__name__ == "LocalAdam"
    assert tuple(module.algorithm.betas) == (0.9, 0.99) and module.algorithm.eps == 1e-8
    assert data.num_clients == 100 and data.participation.clients_per_round == 10 and data.partition.alpha == 0.1
    assert any(isinstance(c, ExportPretrained) for c in cli.trainer.callbacks)
    assert all(".lora_" in n or ".modules_to_save." in n for n in module.federated_names)


def test_sst2_config_runs_through_the_cli_and_exports_a_peft_adapter(assets, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    args = [
        "--config", str(ROOT / "configs" / "fedit_gpt2_sst2.yaml"), *offline(assets, assets.sst2),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.accelerator", "cpu",
        "--data.init_args.num_clients", "4", "--data.init_args.partition.init_args.alpha", "1.0",
        "--data.init_args.participation.init_args.clients_per_round", "2",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the config's run directories are relative
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared CPU
    try:  # in-process (the console script's import time would dominate); test_cli covers the script itself
        cli = build_cli(args, run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "runs" / "fedit_gpt2_sst2"
    rows = (run / "version_0" / "metrics.csv").read_text()
    assert "val/acc" in rows
    base = AutoModelForSequenceClassification.from_pretrained(str(assets.gpt2), num_labels=2)
    adapter = PeftModel.from_pretrained(base, str(run / "version_0" / "adapter"))
    ckpt = torch.load(run / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    key = next(k for k in ckpt if ".lora_B." in k)
    named = dict(adapter.named_parameters())
    assert torch.equal(named[key.removeprefix("model.net.")], ckpt[key])


@pytest.mark.parametrize("task", ["sst2", "20news", "qqp", "qnli"])
def test_fedit_sweeps_resolve_to_the_paper_runs(assets, task):
    import yaml

    name = f"fedit_gpt2_{task}"
    spec = yaml.safe_load((ROOT / "configs" / f"{name}_sweep.yaml").read_text())
    assert spec["base"] == f"configs/{name}.yaml" and len(spec["seeds"]) == 4
    lr_l, lr_g = PAPER[name][:2]
    assert spec["targets"] == [{"sst2": 0.85}.get(task, 0.75)]
    expected = {"FedIT-Adam": "LocalAdam", "FedIT-AdamET": "FAdamET", "FedIT-AdamGT": "FAdamGT"}
    if task == "sst2":
        expected.update(FedAvg="FedAvg", SCAFFOLD="SCAFFOLD")
    assert set(spec["runs"]) == set(expected)
    files = {"train": assets.sst2["train"], "validation": assets.sst2["validation"], "test": assets.sst2["validation"]}
    for run_name, run in spec["runs"].items():
        args = ["--config", str(ROOT / spec["base"]), *offline(assets, files)]
        for key, value in {**spec["overrides"], **run}.items():
            args += [f"--{key}", json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
        cli = build_cli(args, run=False)
        algorithm = cli.model.algorithm
        assert type(algorithm).__name__ == expected[run_name]
        if run_name.startswith("FedIT"):
            assert algorithm.global_lr == lr_g and cli.model.local.lr == lr_l
            assert tuple(algorithm.betas) == (0.9, 0.99) and algorithm.eps == 1e-8
        if run_name in ("FedIT-AdamET", "FedIT-AdamGT"):
            assert algorithm.tracking.count(10) == 10, "Y = S"


def test_the_batched_sst2_config_trains_every_round_stacked_through_the_cli(assets, tmp_path, monkeypatch):
    args = [
        "--config", str(ROOT / "configs" / "fedit_gpt2_sst2_batched.yaml"), *offline(assets, assets.sst2),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.accelerator", "cpu",
        "--data.init_args.num_clients", "4", "--data.init_args.partition.init_args.alpha", "1.0",
        "--data.init_args.participation.init_args.clients_per_round", "2", "--model.local.batch_size", "4",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    cli = build_cli(args, run=False)
    assert cli.model.local.epochs == 1 and type(cli.model.algorithm).__name__ == "LocalAdam"
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    executor = cli.model.executor.inner
    assert type(executor).__name__ == "BatchedExecutor" and not executor.fallbacks and executor.stats["stacked_rounds"] == 2
    run = tmp_path / "runs" / "fedit_gpt2_sst2_batched"
    assert "val/acc" in (run / "version_0" / "metrics.csv").read_text()
    assert (run / "version_0" / "adapter" / "adapter_model.safetensors").is_file()

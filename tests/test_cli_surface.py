"""The command line a researcher touches on every run: class help, the server lr schedule,
--optimizer refused, the config in every logger, one seed, a terminal counted in rounds."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fl_lightning.commands.cli import build_cli, main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _cli(*args: str):
    return subprocess.run(
        [sys.executable, "-m", "fl_lightning.commands.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _csv_logger(tmp_path: Path, name: str) -> list[str]:
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": name}}
    return ["--trainer.logger", yaml.safe_dump(logger, default_flow_style=True).strip()]


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "flag, cls, expected",
    [
        ("--model.algorithm.help", "FedProx", "--model.algorithm.mu"),
        ("--model.model.help", "MLP", "--model.model.hidden"),
        ("--data.help", "FederatedDataModule", "--data.num_clients"),
        ("--model.compression.up.help", "TopK", "--up.ratio"),
    ],
)
def test_class_help_prints_the_class_arguments(flag, cls, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", flag, cls])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    assert expected in out and "unrecognized" not in err


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_optimizer_is_refused_in_one_line_pointing_to_the_server_optimizer(where, tmp_path, capsys):
    extra = ["--optimizer", "Adam"]
    if where == "config file":
        (tmp_path / "opt.yaml").write_text("optimizer:\n  class_path: torch.optim.Adam\n")
        extra = ["--config", str(tmp_path / "opt.yaml")]
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", QUICKSTART, *extra])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert len(err.splitlines()) == 1
    assert "--model.algorithm.init_args.global_lr" in err and "server_optimizer" in err


def _fit(tmp_path: Path, name: str, *args: str):
    cli = build_cli(
        ["--config", QUICKSTART, "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.callbacks", "[]", *_csv_logger(tmp_path, name), *args],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def test_lr_scheduler_drives_the_server_lr_once_per_round(tmp_path):
    plain = _fit(tmp_path, "plain")
    step = _fit(tmp_path, "step", "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5")
    assert not plain.trainer.lr_scheduler_configs
    assert isinstance(step.trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)
    # the actual server optimizer's lr followed the schedule: 1, 0.5, 0.25, 0.125 used, 0.0625 next
    assert step.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1.0 * 0.5**4)
    rows = _rows(Path(step.trainer.logger.log_dir) / "metrics.csv")
    logged = {int(r["step"]): float(r["train/server_lr"]) for r in rows if r.get("train/server_lr")}
    assert logged == {0: 1.0, 1: 0.5, 2: 0.25, 3: 0.125}
    # and it changed the run: same seed, same data, different global model
    first_diff = [
        not torch.equal(a, b) for a, b in zip(plain.model.federated_parameters(), step.model.federated_parameters())
    ]
    assert any(first_diff)
    # the scheduler is in the checkpointable state of the trainer
    assert step.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4


def test_any_torch_scheduler_class_is_accepted(tmp_path):
    cli = _fit(tmp_path, "cos", "--lr_scheduler", "CosineAnnealingLR", "--lr_scheduler.T_max", "4")
    rows = _rows(Path(cli.trainer.logger.log_dir) / "metrics.csv")
    lrs = [float(r["train/server_lr"]) for r in rows if r.get("train/server_lr")]
    assert lrs[0] == pytest.approx(1.0) and lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.5


def test_the_full_config_goes_to_every_logger_and_each_run_keeps_its_config(tmp_path):
    a = _fit(tmp_path, "run", "--model.local.lr", "0.02")
    b = _fit(tmp_path, "run", "--model.local.lr", "0.03")  # same logger name: the next version
    dir_a, dir_b = Path(a.trainer.logger.log_dir), Path(b.trainer.logger.log_dir)
    assert dir_a != dir_b
    for directory, lr in ((dir_a, 0.02), (dir_b, 0.03)):
        saved = yaml.safe_load((directory / "config.yaml").read_text())
        hparams = yaml.safe_load((directory / "hparams.yaml").read_text())
        assert saved["model"]["local"]["lr"] == lr and hparams["model"]["local"]["lr"] == lr
        assert hparams["model"]["algorithm"]["class_path"] == "fl_lightning.algorithms.FedAvg"
        assert hparams["data"]["init_args"]["num_clients"] == 20 and hparams["trainer"]["max_steps"] == 4
    assert not (tmp_path / "config.yaml").exists()


def test_wandb_offline_run_carries_the_config_and_a_default_name(tmp_path, wandb_offline):
    cli = build_cli(
        ["--config", QUICKSTART, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--seed_everything", "3",
         "--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.offline", "true",
         "--trainer.logger.project", "fl-lightning-test", "--trainer.logger.save_dir", str(tmp_path)],
        run=False,
    )  # fmt: skip
    assert "anonymous" not in cli.trainer.logger._wandb_init  # no wandb deprecation warning on every run
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    experiment = cli.trainer.logger.experiment
    config = dict(experiment.config)
    run_files = Path(experiment.dir)
    experiment.finish()
    assert experiment.name == "quickstart-FedAvg-seed3"
    assert config["model"]["algorithm"]["class_path"] == "fl_lightning.algorithms.FedAvg"
    assert config["model"]["local"]["lr"] == 0.05 and config["seed_everything"] == 3
    assert config["data"]["init_args"]["seed"] == 3
    assert yaml.safe_load((run_files / "cli_config.yaml").read_text())["model"]["local"]["lr"] == 0.05
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    deadline, recorded = time.time() + 20, b""
    while time.time() < deadline:  # wandb's service writes the run file asynchronously: slow on a loaded machine
        recorded = next(run.glob("run-*.wandb")).read_bytes()  # what `wandb sync` uploads
        if b"quickstart-FedAvg-seed3" in recorded and b'"init_args":{"global_lr":1.0}' in recorded:
            break
        time.sleep(0.2)
    assert b"quickstart-FedAvg-seed3" in recorded and b'"init_args":{"global_lr":1.0}' in recorded


def _partition(*args: str) -> tuple[int, list[list[int]]]:
    cli = build_cli(["--config", QUICKSTART, "--trainer.logger", "false", *args], run=False)
    cli.datamodule.setup("fit")
    return cli.datamodule.seed, [cli.datamodule.client_train[c].tolist() for c in range(3)]


def test_seed_everything_seeds_the_partition_unless_data_seed_is_explicit():
    seed_1, split_1 = _partition("--seed_everything", "1")
    seed_2, split_2 = _partition("--seed_everything", "2")
    assert (seed_1, seed_2) == (1, 2) and split_1 != split_2
    seed, split = _partition("--seed_everything", "2", "--data.init_args.seed", "1")
    assert seed == 1 and split == split_1


def test_help_lists_every_subcommand_fast_and_version():
    start = time.perf_counter()
    proc = _cli("--help")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0
    for subcommand in ("fit", "validate", "test", "predict", "compare", "montecarlo", "partition", "fixture"):
        assert f"  {subcommand} " in proc.stdout
    assert seconds < 3.0, f"fl-lightning --help took {seconds:.1f} s"
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("fl-lightning ")


SHORT_PAGE_SETTINGS = ("--model.algorithm ", "--model.local.lr ", "--model.local.steps ", "--model.local.batch_size ",
                       "--data.init_args.num_clients ", "--data.init_args.holdout_fraction ", "--data.init_args.val_fraction ",
                       "--trainer.max_steps ", "--trainer.val_check_interval ", "--model.compression.up ", "--model.privacy.delta ",
                       "--model.execution ", "--model.personal ", "--model.clock.speed_sigma ", "--model.asynchronous.mode ",
                       "--model.lora_aggregation ", "--model.stages ", "--help-all")  # fmt: skip


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_help_is_a_short_page_of_the_projects_settings_without_lightning(subcommand, tmp_path):
    probe = ("import sys\nfrom fl_lightning.commands.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('LIGHTNING' if 'lightning.pytorch' in sys.modules else 'NO_LIGHTNING', code)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FL_LIGHTNING_CACHE_DIR": "off"}
    proc = subprocess.run([sys.executable, "-c", probe, subcommand, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    page = proc.stdout.splitlines()
    assert proc.returncode == 0 and page[-1] == "NO_LIGHTNING 0", proc.stderr
    assert len(page) - 1 < 80 and max(map(len, page)) <= 100
    assert page[0].startswith(f"usage: fl-lightning {subcommand} ")
    assert all(setting in proc.stdout for setting in SHORT_PAGE_SETTINGS)


def test_help_all_lists_every_setting_lightnings_included(capsys, monkeypatch):
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", "off")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--help-all"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--trainer.accumulate_grad_batches" in out and "--model.local.lr" in out and len(out.splitlines()) > 500


def test_fit_terminal_is_in_rounds_without_boilerplate_and_ends_with_the_result(tmp_path):
    proc = _cli("fit", "--config", QUICKSTART, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                "--trainer.default_root_dir", str(tmp_path), *_csv_logger(tmp_path, "q"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in ("GPU available", "TPU available", "Tip:", "args parameter is intended", "Epoch 0", "v_num"):
        assert noise not in proc.stderr + proc.stdout, noise
    assert "round 3/3" in proc.stderr and "train loss" in proc.stderr and "val acc" in proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("FedAvg: 3 rounds in ") and "final val acc" in line and "best" in line and "MB sent" in line


def test_the_server_lr_schedule_continues_across_a_resume(tmp_path):
    schedule = ["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5"]
    whole = _fit(tmp_path, "whole", *schedule)  # 4 rounds
    def cli(rounds: int, name: str):
        return build_cli(
            ["--config", QUICKSTART, "--trainer.max_steps", str(rounds), "--trainer.val_check_interval", "4",
             "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.callbacks", "[]", *_csv_logger(tmp_path, name), *schedule],
            run=False,
        )  # fmt: skip

    first = cli(2, "first")
    first.trainer.fit(first.model, datamodule=first.datamodule)
    first.trainer.save_checkpoint(tmp_path / "round2.ckpt")
    second = cli(4, "second")
    second.trainer.fit(second.model, datamodule=second.datamodule, ckpt_path=tmp_path / "round2.ckpt", weights_only=True)
    rows = _rows(Path(second.trainer.logger.log_dir) / "metrics.csv")
    assert {int(r["step"]): float(r["train/server_lr"]) for r in rows if r.get("train/server_lr")} == {2: 0.25, 3: 0.125}
    for a, b in zip(whole.model.federated_parameters(), second.model.federated_parameters()):
        assert torch.equal(a, b)


def test_batched_execution_in_groups_from_the_command_line(tmp_path):
    """``--model.execution.class_path BatchedExecutor --model.execution.init_args.max_stacked_clients 2``:
    quickstart's 5 clients a round train in stacks of at most 2, every round stacked."""
    cli = _fit(
        tmp_path, "grouped", "--model.execution.class_path", "fl_lightning.executors.BatchedExecutor",
        "--model.execution.init_args.max_stacked_clients", "2",
    )  # fmt: skip
    executor = cli.model.executor.inner
    assert executor.max_stacked_clients == 2 and not executor.fallbacks
    assert cli.trainer.global_step == 4


def test_a_bad_max_stacked_clients_fails_in_one_line_before_training(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", QUICKSTART, "--model.execution.class_path", "fl_lightning.executors.BatchedExecutor",
              "--model.execution.init_args.max_stacked_clients", "0"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "execution.max_stacked_clients must be an integer >= 1" in err


@pytest.mark.parametrize("executor", ["SequentialExecutor", "BatchedExecutor"])
def test_a_bad_compile_unit_fails_in_one_line_before_training(executor, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", QUICKSTART, "--model.execution.class_path", f"fl_lightning.executors.{executor}",
              "--model.execution.init_args.compile", "true", "--model.execution.init_args.compile_unit", "epoch"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "execution.compile_unit must be one of ['auto', 'step', 'round'], got 'epoch'" in err

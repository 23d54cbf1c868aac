"""Issue 27 item 2 and issue 26: every configuration error is one line (no usage block, no
traceback), exit code 2, naming the setting, where it was given and what is allowed."""

from pathlib import Path

import pytest

from fl_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
QUICK = ["--config", QUICKSTART, "--trainer.max_steps", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]


def _one_line(capsys, *args: str) -> str:
    """The command's stderr, which must be exactly one `fl-lightning: error:` line, and exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("fl-lightning: error: "), err
    return err[0].removeprefix("fl-lightning: error: ")


@pytest.mark.parametrize(
    "flag, value, near, listed",
    [
        ("--model.algorithm", "FedProxx", "FedProx", ["FedAvg", "SCAFFOLD", "FedAdam"]),
        ("--model.algorithm", "fl_lightning.algorithms.FedProxx", "FedProx", ["FedAvg"]),
        ("--model.model", "SmallCNNN", "SmallCNN", ["MLP", "ResNet18"]),
        ("--data", "FederatedDataModul", "FederatedDataModule", ["VisionDataModule", "TextDataModule"]),
        ("--data.init_args.partition", "Dirichlett", "Dirichlet", ["IID", "Shards"]),
        ("--data.init_args.participation", "UniformSamplin", "UniformSampling", ["BernoulliParticipation"]),
        ("--model.store", "DiskClientStor", "DiskClientStore", ["ClientStore"]),
        ("--lr_scheduler", "StepLRR", "StepLR", ["CosineAnnealingLR"]),
    ],
)
def test_an_unknown_class_lists_the_allowed_names_and_the_nearest(capsys, flag, value, near, listed):
    line = _one_line(capsys, "fit", *QUICK, flag, value)
    assert line.startswith(f"{flag}: no ") and repr(value) in line
    assert f"did you mean {near}?" in line
    allowed = line.split("allowed: ", 1)[1]
    assert all(name in allowed.split(" (or")[0].split(", ") for name in [near, *listed])


def test_an_unknown_executor_name_says_the_nearest(capsys):
    line = _one_line(capsys, "fit", *QUICK, "--model.execution", "batchd")
    assert "execution must be one of ['auto', 'batched', 'sequential']" in line and line.endswith("did you mean batched?")


def test_a_typo_in_a_yaml_key_names_the_file_and_the_nearest_key(tmp_path, capsys):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(f"base: {QUICKSTART}\nmodel:\n  local:\n    lrr: 0.1\n")
    line = _one_line(capsys, "fit", "--config", str(overlay), "--trainer.max_steps", "1")
    assert line == f"{overlay}: unknown key model.local.lrr; did you mean model.local.lr?"


def test_a_typo_in_a_yaml_class_argument_names_the_file_and_the_arguments(tmp_path, capsys):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(f"base: {QUICKSTART}\nmodel:\n  algorithm:\n    class_path: FedProx\n    init_args:\n      muu: 0.1\n")
    line = _one_line(capsys, "fit", "--config", str(overlay), "--trainer.max_steps", "1")
    assert line.startswith(f"{overlay}: unknown key model.algorithm.init_args.muu (FedProx has no argument 'muu'); did you mean mu?")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.local.lrr", "0.1"], "--model.local.lrr: unknown setting; did you mean --model.local.lr?"),
        (["--trainer.max_stepz", "3"], "--trainer.max_stepz: unknown setting; did you mean --trainer.max_steps?"),
        (["--model.algorithm.init_args.global_lrr", "2"], "--model.algorithm.init_args.global_lrr: unknown setting (FedAvg has no argument 'global_lrr'); did you mean global_lr?"),
    ],
)  # fmt: skip
def test_a_typo_in_a_cli_key_names_the_nearest_key(capsys, args, expected):
    assert _one_line(capsys, "fit", *QUICK, *args).startswith(expected)


def test_a_missing_config_file_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, "fit", "--config", "nope.yaml")
    assert line == "--config nope.yaml: no such file, and no bundled config of that name; `fl-lightning configs` lists the bundled ones"


def test_a_duplicate_yaml_key_names_the_key_and_the_file(tmp_path, capsys):
    overlay = tmp_path / "dup.yaml"
    overlay.write_text(f"base: {QUICKSTART}\nmodel:\n  local:\n    lr: 0.1\n    steps: 2\n    lr: 0.2\n")
    line = _one_line(capsys, "fit", "--config", str(overlay))
    assert line == f"{overlay}, line 6, column 5: duplicate key 'lr' (lines 4 and 6: YAML would keep only the last); remove one of them"


def test_a_yaml_syntax_error_in_a_fit_config_names_the_file_and_line(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"base: {QUICKSTART}\nmodel:\n  local: {{lr: 0.1\n")
    line = _one_line(capsys, "fit", "--config", str(broken))
    assert line.startswith(f"{broken}, line ") and "fix the file" in line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.max_steps", "-5"], "trainer.max_steps is the number of rounds and must be >= 1, got -5"),
        (["--trainer.val_check_interval", "-1"], "trainer.val_check_interval must be > 0 (rounds between evaluations, or a fraction in (0, 1]), got -1"),
        (["--trainer.devices", "0"], "--trainer.devices must be >= 1 (processes or GPUs), -1 or auto (all), got 0"),
        (["--trainer.enable_checkpointing", "false"], "--trainer.enable_checkpointing false, but trainer.callbacks holds a ModelCheckpoint (the config's); drop it too (--trainer.callbacks '[]') or leave checkpointing on"),
        (["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "0"], "--lr_scheduler.step_size of StepLR must be >= 1 (rounds), got 0"),
        (["--model.model.init_args.num_classes", "1000000000"], "out of memory building the model and data: tried to allocate 256.0 GB at once; lower model.model.init_args.num_classes=1000000000"),
    ],
)  # fmt: skip
def test_settings_lightning_or_torch_would_refuse_with_a_traceback_are_one_line(capsys, args, expected):
    quick = ["--config", QUICKSTART, "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1"]
    assert _one_line(capsys, "fit", *quick, *args) == expected


def test_a_gpu_accelerator_without_a_gpu_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = _one_line(capsys, "fit", *QUICK, "--trainer.accelerator", "gpu")
    assert line == "--trainer.accelerator gpu: this machine has no usable GPU; use --trainer.accelerator cpu (or auto)"


def test_other_lightning_misconfigurations_are_one_line():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from fl_lightning.core.errors import explain

    line = explain(MisconfigurationException("`Trainer(strategy='x')`\n is not\n valid"))
    assert line == "a trainer setting was refused by Lightning: `Trainer(strategy='x')` is not valid; see `fl-lightning fit --help-all` (the --trainer.* settings)"


def test_compare_with_a_yaml_syntax_error_or_an_out_file_is_one_line(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {QUICKSTART}\nseeds: [0]\nruns:\n  a: {{model.local.lr: 0.1\n  b: {{}}\n")
    line = _one_line(capsys, "compare", "--config", str(sweep), "--out", str(tmp_path / "out"))
    assert line.startswith(f"{sweep}, line ") and "fix the file" in line
    taken = tmp_path / "taken.txt"
    taken.write_text("mine")
    line = _one_line(capsys, "compare", "--config", str(ROOT / "configs" / "compare_quickstart.yaml"), "--out", str(taken))
    assert line == f"--out {taken} is a file; give a folder (compare writes runs/, plots and summary.md into it)"
    assert taken.read_text() == "mine"


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    assert "--model.algorithm" in capsys.readouterr().out

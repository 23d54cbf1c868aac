"""A bad value (``--model.local.lr -1``, a ``TopK`` ratio 1.5, ``privacy.delta 2``, a nested class typo)
is one line naming the setting and its range, exit code 2, before Lightning is imported; every bad
setting of the command is reported, one line each; the early line is the class's own message
(fl_lightning/run/setting_ranges.py)."""

from __future__ import annotations

import functools

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fl_lightning.commands import cli
from fl_lightning.commands.cli import main
from fl_lightning.run.config_files import expand_bases
from fl_lightning.run.setting_check import check_all
from fl_lightning.run.setting_ranges import MAX_LOCAL_STEPS, NESTED_CLASSES, NO_GLOBAL_LR, PROJECT_ALGORITHMS, RANGES, refusal

ROOT = Path(__file__).resolve().parents[1]
JSONARGPARSE_WORDING = ("Does not validate against any", "Union subtypes", "Parser key", "Given value", "Subtypes:", "NoneType", "<class")
# the other arguments an owner needs for the sample bad value to be the first it refuses
NEEDS = {"model.local.epochs": {"steps": None}}


def _owner(entry):
    module, _, name = entry.owner.partition(":")
    return getattr(importlib.import_module(module), name)


def _owners_message(key: str) -> str:
    entry = RANGES[key]
    arg = key.rpartition(".")[2]
    owner = _owner(entry)
    with pytest.raises(ValueError) as refused:
        if key.startswith("trainer."):
            owner({arg: entry.bad}, fit=True)
        else:
            owner(**{arg: entry.bad, **NEEDS.get(key, {})})
    return str(refused.value)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_refuses_with_its_owners_own_message(key):
    """The class (or the CLI's trainer check) stays the authority: the table only repeats its message."""
    assert refusal(key, RANGES[key].bad) == _owners_message(key)


@pytest.mark.parametrize("name", PROJECT_ALGORITHMS)
def test_global_lr_is_refused_by_every_algorithm_with_the_same_message(name):
    import fl_lightning.algorithms as algorithms

    takes_it = "global_lr" in inspect.signature(getattr(algorithms, name)).parameters
    assert takes_it == (name not in NO_GLOBAL_LR)
    if not takes_it:
        return
    with pytest.raises(ValueError) as refused:
        getattr(algorithms, name)(global_lr=0.0)
    assert str(refused.value) == refusal("model.algorithm[*].global_lr", 0.0)


def test_the_tables_agree_with_the_classes():
    import fl_lightning.algorithms as algorithms
    from fl_lightning.core.config import MAX_LOCAL_STEPS as CLASS_MAX
    from fl_lightning.run.config_errors import allowed_classes

    assert MAX_LOCAL_STEPS == CLASS_MAX
    assert set(PROJECT_ALGORITHMS) == set(allowed_classes([algorithms.Algorithm])) - {"Algorithm"}
    bases = {"Compressor": "fl_lightning.compression:Compressor", "Participation": "fl_lightning.core.participation:Participation",
             "Partitioner": "datamodules.partition:Partitioner"}  # fmt: skip
    for key, (kind, names) in NESTED_CLASSES.items():
        module, _, name = bases[kind].partition(":")
        assert list(names) == allowed_classes([getattr(importlib.import_module(module), name)]), key
    for key, entry in RANGES.items():  # every class argument of the table is an argument of its class
        if "[" in key and "*" not in key:
            assert key.rpartition(".")[2] in inspect.signature(_owner(entry)).parameters, key


def _fit_configs() -> list[Path]:
    return [p for p in sorted((ROOT / "configs").glob("*.yaml")) if not {"runs", "methods"} & set(yaml.safe_load(p.read_text()))]


@pytest.mark.parametrize("path", _fit_configs(), ids=lambda p: p.stem)
def test_no_shipped_config_is_refused(path):
    assert check_all(expand_bases(["fit", "--config", str(path)]), None) == []


def test_allowed_values_at_the_edges_are_not_refused():
    args = ["fit", "--config", "quickstart", "--model.local.lr", "1e-3", "--model.local.steps", "null", "--model.local.epochs", "1",
            "--model.local.batch_size", "null", "--trainer.val_check_interval", "0.5", "--data.init_args.participation.clients_per_round", "1",
            "--model.compression.up", "TopK", "--model.compression.up.init_args.ratio", "1", "--model.privacy.delta", "0.5",
            "--model.privacy.target_epsilon", "null", "--model.algorithm", "FedProx", "--model.algorithm.mu", "0",
            "--data.init_args.holdout_fraction", "0.2", "--data.init_args.val_fraction", "0.7", "--model.compression.down", "QSGD",
            "--model.compression.down.levels", "4", "--model.algorithm.help", "FedProx"]  # fmt: skip
    assert check_all(expand_bases(cli._bundled_config_names(args)), None) == []


def test_a_class_of_another_package_or_a_new_class_path_is_left_to_the_parser():
    base = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml")]
    assert check_all(base + ["--model.compression.up", "mine.Sparsifier", "--model.compression.up.ratio", "7"], None) == []
    # the ratio belonged to the TopK that QSGD replaced: a new class_path starts its own init_args
    assert check_all(base + ["--model.compression.up", "TopK", "--model.compression.up.ratio", "7", "--model.compression.up", "QSGD"], None) == []
    # validate/test/predict do not train: max_steps is not theirs to refuse
    assert check_all(["test", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "0"], None) == []


def _lines(capsys, monkeypatch, *args: str) -> list[str]:
    """The command's stderr lines (each `fl-lightning: error: `), exit code 2, without building the parser."""
    def no_parser(*a, **k):
        raise AssertionError("the parser was built: the early check let the error through")

    monkeypatch.setattr(cli, "build_cli", no_parser)
    with pytest.raises(SystemExit) as done:
        main(list(args))
    assert done.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert all(line.startswith("fl-lightning: error: ") for line in lines), lines
    assert not any(word in line for line in lines for word in JSONARGPARSE_WORDING), lines
    return [line.removeprefix("fl-lightning: error: ") for line in lines]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.local.lr", "-1"], "local.lr must be > 0 and finite, got -1.0"),
        (["--model.compression.up", "TopK", "--model.compression.up.ratio", "1.5"], "TopK.ratio must be in (0, 1], got 1.5"),
        (["--model.compression.up", "TopKK"], "--model.compression.up: no Compressor named 'TopKK'; did you mean TopK? allowed: Cast, "
         "Compressor, Identity, Int8, QSGD, RandomK, ScaledSign, TopK (or the full import path of your own subclass)"),
        (["--model.privacy.delta", "2"], "privacy.delta must be in (0, 1), got 2.0"),
        (["--model.privacy.noise_multiplier", "-1"], "privacy.noise_multiplier must be >= 0 (finite), got -1.0"),
        (["--model.local.steps", "0"], "local.steps must be >= 1, got 0"),
        (["--model.local.batch_size", "0"], "local.batch_size must be >= 1 (or null for full batch), got 0"),
        (["--trainer.max_steps", "0"], "trainer.max_steps is the number of rounds and must be >= 1, got 0"),
        (["--data.init_args.holdout_fraction", "1"], "holdout_fraction must be in [0, 1), got 1.0"),
        (["--data.init_args.num_clients", "0"], "num_clients must be >= 1, got 0"),
        (["--data.init_args.participation.clients_per_round", "1.5"], "clients_per_round as a fraction must be in (0, 1], got 1.5"),
        (["--model.compression.down", "QSGD", "--model.compression.down.init_args.levels", "0"], "QSGD.levels (s) must be an integer >= 1, got 0"),
        (["--model.algorithm", "FedProx", "--model.algorithm.mu", "-1"], "FedProx mu must be >= 0, got -1.0"),
        (["--model.algorithm.init_args.global_lr", "0"], "algorithm global_lr must be > 0, got 0.0"),
        (["--data.init_args.partition", "Dirichlett"], "--data.init_args.partition: no Partitioner named 'Dirichlett'; did you mean "
         "Dirichlet? allowed: Contiguous, Dirichlet, FlwrPartition, IID, NaturalPartition, QuantitySkew, Shards (or the full import path of your own subclass)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_before_the_parser(capsys, monkeypatch, args, expected):
    assert _lines(capsys, monkeypatch, "fit", "--config", "quickstart", *args) == [expected]


def test_every_bad_setting_of_files_and_command_line_is_reported(capsys, monkeypatch, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "base: quickstart\nmodel:\n  local:\n    weight_decay: -1\n  privacy:\n    delta: 2\n"
        "  compression:\n    up: {class_path: TopK, init_args: {ratio: 1.5}}\n    down: TopKK\n"
        "data:\n  init_args:\n    val_fraction: 0.95\n    holdout_fraction: 0.1\n"
    )
    lines = _lines(capsys, monkeypatch, "fit", "--config", str(mine), "--model.local.lr", "-1", "--trainer.max_steps", "-5",
                   "--model.compression.up.ratio", "2")  # fmt: skip
    assert sorted(lines) == sorted([
        f"--model.compression.down: no Compressor named 'TopKK' (in {mine}); did you mean TopK? allowed: Cast, Compressor, Identity, "
        "Int8, QSGD, RandomK, ScaledSign, TopK (or the full import path of your own subclass)",
        "local.weight_decay must be >= 0, got -1.0",
        "local.lr must be > 0 and finite, got -1.0",
        "privacy.delta must be in (0, 1), got 2.0",
        "TopK.ratio must be in (0, 1], got 2.0",
        "val_fraction must be in [0, 1 - holdout_fraction) = [0, 0.9), got 0.95",
        "trainer.max_steps is the number of rounds and must be >= 1, got -5",
    ])  # fmt: skip


def test_a_value_error_is_reported_without_importing_lightning(tmp_path):
    probe = ("import sys\nfrom fl_lightning.commands.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('LIGHTNING' if 'lightning.pytorch' in sys.modules else 'NO_LIGHTNING', 'TORCH' if 'torch' in sys.modules else 'NO_TORCH', code)")  # fmt: skip
    env = {**os.environ, "FL_LIGHTNING_CACHE_DIR": "off"}
    proc = subprocess.run([sys.executable, "-c", probe, "fit", "--config", "quickstart", "--model.local.lr", "-1", "--model.privacy.delta", "2"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.stdout.split() == ["NO_LIGHTNING", "NO_TORCH", "2"]
    assert proc.stderr.splitlines() == ["fl-lightning: error: local.lr must be > 0 and finite, got -1.0",
                                        "fl-lightning: error: privacy.delta must be in (0, 1), got 2.0"]  # fmt: skip


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.compression.up", "TopK", "--model.compression.up.ratio", "1.5"], "TopK.ratio must be in (0, 1], got 1.5"),
        (["--model.compression.up", "TopKK"], "--model.compression.up: no Compressor named 'TopKK'; did you mean TopK?"),
        (["--model.local.steps", "1.5"], "--model.local.steps: expected an integer, got 1.5"),
        # an executor's refusal, without the str alternative of the execution setting's union ("Expected a <class 'str'>")
        (["--model.execution", "fl_lightning.executors.BatchedExecutor", "--model.execution.init_args.steps_per_call", "3"],
         "execution.steps_per_call must be 1 or 2, got 3"),
    ],
)
def test_the_parsers_own_line_has_no_jsonargparse_wording(capsys, monkeypatch, args, expected):
    """Without the early check (as for a class the table does not know) the parser's line is as plain."""
    monkeypatch.setattr(cli, "_check_settings", lambda argv, **kwargs: None)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "quickstart", *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert done.value.code == 2 and len(err) == 1, err
    assert err[0].removeprefix("fl-lightning: error: ").startswith(expected)
    assert not any(word in err[0] for word in JSONARGPARSE_WORDING), err


def test_with_user_modules_values_are_still_checked_and_class_names_left_to_the_parser(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_stages.py").write_text("X = 1\n")
    assert _lines(capsys, monkeypatch, "--import", "my_stages", "fit", "--config", "quickstart", "--model.local.lr", "-1") == [
        "local.lr must be > 0 and finite, got -1.0"
    ]
    args = expand_bases(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.compression.up", "MyCompressor"])
    assert check_all(args, None, user_modules=True) == [] and len(check_all(args, None)) == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--data.init_args.new_client_fraction", "0.2"], "data.new_client_fraction=0.2 needs data.holdout_fraction in (0, 1) (unseen "
         "clients are scored on their held-out split), got 0"),
        (["--data.init_args.new_client_fraction", "0.99", "--data.init_args.holdout_fraction", "0.2"],
         "data.new_client_fraction=0.99 of num_clients=20 leaves no client to train"),
    ],
)  # fmt: skip
def test_a_rule_across_settings_is_refused_before_the_trainer_is_built(capsys, monkeypatch, args, expected):
    """Rules the early table leaves to the classes are still refused before Lightning's start-up (the Trainer)."""
    from lightning.pytorch import Trainer

    @functools.wraps(Trainer.__init__)  # the parser reads the trainer's settings from this signature
    def no_trainer(*a, **k):
        raise AssertionError("the Trainer was built: the rule was checked after Lightning's start-up")

    monkeypatch.setattr(Trainer, "__init__", no_trainer)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "quickstart", *args])
    assert done.value.code == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.strip()] == [f"fl-lightning: error: {expected}"]

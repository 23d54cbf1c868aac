"""Unknown keys and class names refused before Lightning is imported (fl_lightning/run/setting_check.py):
the same line as the parser's, and never a refusal of a setting the parser accepts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_lightning.commands.cli import main
from fl_lightning.run.config_files import expand_bases
from fl_lightning.run.setting_check import check, load_schema

ROOT = Path(__file__).resolve().parents[1]
TYPOS = {
    "class on the command line": ["--model.algorithm", "FedProxx"],
    "key on the command line": ["--model.local.lrr", "0.1"],
    "key under the wrong group": ["--model.lrr", "0.1"],
    "top-level key": ["--trainr.max_steps", "3"],
    "class of a help request": ["--model.algorithm.help", "FedProxx"],
}
FILE_TYPOS = {
    "key in a file": "model:\n  local:\n    lrr: 0.1\n",
    "class in a file": "model:\n  algorithm: FedProxx\n",
    "class_path in a file": "model:\n  algorithm:\n    class_path: FedProxx\n",
    "top-level key in a file": "trainr:\n  max_steps: 3\n",
}


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    saved = os.environ.get("FL_LIGHTNING_CACHE_DIR")
    os.environ["FL_LIGHTNING_CACHE_DIR"] = str(store)
    try:
        with pytest.raises(SystemExit):
            main(["fit", "--model.algorithm.help", "FedAvg"])  # any command that builds the parser stores it
        found = load_schema("fit")
    finally:
        os.environ["FL_LIGHTNING_CACHE_DIR"] = saved if saved is not None else "off"
    assert found is not None and "model.local.lr" in found["known"] and "model.algorithm" in found["classes"]
    return store, found


def _fit_configs() -> list[Path]:
    import yaml

    return [p for p in sorted((ROOT / "configs").glob("*.yaml")) if not {"runs", "methods"} & set(yaml.safe_load(p.read_text()))]  # no sweep, no study


@pytest.mark.parametrize("path", _fit_configs(), ids=lambda p: p.stem)
def test_no_shipped_config_is_refused(schema, path):
    assert check(expand_bases(["fit", "--config", str(path)]), schema[1]) is None


def test_the_settings_the_docs_show_are_not_refused(schema):
    args = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.local.lr", "0.02", "--trainer.max_steps", "3",
            "--threads", "2", "--data.init_args.val_fraction", "0", "--data.val_fraction", "0", "--model.algorithm", "FedProx",
            "--model.algorithm.mu", "0.1", "--model.algorithm.init_args.mu", "0.1", "--trainer.callbacks+=EarlyStopping",
            "--model.algorithm", "fl_lightning.algorithms.FedAvg", "--model.execution", "batched", "--seed_everything", "3",
            "--trainer.logger", "false", "--model.faults.dropout", "0.1", "--model.init_args.local.lr", "0.1"]  # fmt: skip
    assert check(expand_bases(args), schema[1]) is None


def _slow_line(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("name", list(TYPOS) + list(FILE_TYPOS))
def test_the_early_line_is_the_parsers_line(schema, name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if name in TYPOS:
        args = ["fit", "--config", "quickstart", *TYPOS[name]]
    else:
        (tmp_path / "mine.yaml").write_text("base: quickstart\n" + FILE_TYPOS[name])
        args = ["fit", "--config", "mine.yaml"]
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", "off")
    slow = _slow_line(args, capsys)
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", str(schema[0]))
    from fl_lightning.commands import cli
    def no_parser(*a, **k):
        raise AssertionError("the parser was built: the early check let the error through")

    monkeypatch.setattr(cli, "build_cli", no_parser)
    fast = _slow_line(args, capsys)
    assert fast == slow and fast.startswith("fl-lightning: error: ") and "did you mean" in fast


def test_a_typo_is_reported_without_importing_lightning(schema, tmp_path):
    probe = ("import sys\nfrom fl_lightning.commands.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('LIGHTNING' if 'lightning.pytorch' in sys.modules else 'NO_LIGHTNING', code)")  # fmt: skip
    env = {**os.environ, "FL_LIGHTNING_CACHE_DIR": str(schema[0])}
    proc = subprocess.run([sys.executable, "-c", probe, "fit", "--config", "quickstart", "--model.local.lrr", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.stdout.split() == ["NO_LIGHTNING", "2"]
    assert proc.stderr.strip() == "fl-lightning: error: --model.local.lrr: unknown setting; did you mean --model.local.lr?"

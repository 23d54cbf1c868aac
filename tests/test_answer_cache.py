"""Stored answers of ``fit --help`` / ``--print_config`` (fl_lightning/run/answer_cache.py): the same text,
without importing Lightning, and a new answer whenever an input of it changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_lightning.run import answer_cache
from fl_lightning.commands.cli import main

PROBE = """
import sys
from fl_lightning.commands.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    code = done.code
else:
    code = 0
print("LIGHTNING_IMPORTED" if "lightning.pytorch" in sys.modules else "LIGHTNING_NOT_IMPORTED", code, file=sys.stderr)
"""


def _ask(args: list[str], store: Path, cwd: Path) -> tuple[str, str]:
    env = {**os.environ, "FL_LIGHTNING_CACHE_DIR": str(store), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    return proc.stdout, proc.stderr.strip().splitlines()[-1]


def test_a_stored_answer_is_the_same_text_printed_without_importing_lightning_and_changes_with_its_config(tmp_path):
    store = tmp_path / "store"
    config = tmp_path / "run.yaml"
    config.write_text("base: quickstart\nmodel:\n  local:\n    lr: 0.125\n")

    first, how = _ask(["fit", "--config", str(config), "--print_config"], store, tmp_path)
    assert how == "LIGHTNING_IMPORTED 0" and "lr: 0.125" in first
    again, how = _ask(["fit", "--config", str(config), "--print_config"], store, tmp_path)
    assert how == "LIGHTNING_NOT_IMPORTED 0" and again == first

    config.write_text("base: quickstart\nmodel:\n  local:\n    lr: 0.25\n")  # an edited config is a new request
    edited, how = _ask(["fit", "--config", str(config), "--print_config"], store, tmp_path)
    assert how == "LIGHTNING_IMPORTED 0" and "lr: 0.25" in edited and "lr: 0.125" not in edited

    helped, how = _ask(["fit", "--model.algorithm.help", "FedProx"], store, tmp_path)
    assert how == "LIGHTNING_IMPORTED 0" and "--model.algorithm.mu" in helped
    assert _ask(["fit", "--model.algorithm.help", "FedProx"], store, tmp_path) == (helped, "LIGHTNING_NOT_IMPORTED 0")


def test_errors_and_runs_are_never_stored(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as done:
        main(["fit", "--model.algorithm.help", "FedProxx"])
    assert done.value.code == 2
    assert not list((tmp_path / "answers").glob("*.txt"))  # only the parser's schema (fl_lightning/run/setting_check.py)
    assert not answer_cache.is_read_only(["fit", "--config", "quickstart", "--trainer.max_steps", "2"])
    assert answer_cache.is_read_only(["fit", "--config", "quickstart", "--print_config=skip_null"])


def test_the_store_can_be_switched_off_and_a_broken_config_is_left_to_the_parser(tmp_path, monkeypatch):
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", "off")
    assert answer_cache.store() is None and answer_cache.request_key(["fit", "--help"]) is None
    monkeypatch.setenv("FL_LIGHTNING_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert answer_cache.request_key(["fit", "--config", str(broken), "--print_config"]) is None
    assert answer_cache.request_key(["fit", "--help"]) == answer_cache.request_key(["fit", "--help"])

"""The package's folders (docs/architecture.md, "Layout") and the old flat import names.

Every module that moved from ``fl_lightning/`` into a folder keeps its old name as the *same* module
object (``fl_lightning.package_names.MOVED``): imports, YAML ``class_path`` s and pickles that name
``fl_lightning.<module>`` keep working."""

from __future__ import annotations

import importlib
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fl_lightning
from fl_lightning.package_names import MOVED, moved_name

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [(f"fl_lightning.{m}", f"fl_lightning.{package}.{m}") for package, modules in MOVED.items() for m in modules]
PUBLIC = ["Algorithm", "ClientStore", "FedAvg", "FederatedModule", "LocalTraining", "Participation", "RoundPlan",
          "RoundProgressBar", "UniformSampling", "apply_threads", "quiet_lightning"]  # fmt: skip


def _now(old: str) -> str:
    return moved_name(old) or old


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("old, new", PAIRS, ids=[old for old, _ in PAIRS])
def test_the_old_name_is_the_new_module(old, new):
    assert (ROOT / Path(*new.split("."))).with_suffix(".py").is_file()
    assert not (ROOT / Path(*old.split("."))).with_suffix(".py").exists()
    assert moved_name(old) == new
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]


def test_an_old_name_imported_first_is_the_new_module():
    """A fresh process that names the old modules before the new ones: one module, one class."""
    if not PAIRS:
        pytest.skip("nothing moved")
    lines = ["import importlib, sys"]
    for old, new in PAIRS[:: max(1, len(PAIRS) // 8)]:
        lines += [f"old = importlib.import_module({old!r})", f"assert old is importlib.import_module({new!r}), {old!r}",
                  f"assert old.__name__ == {new!r}"]  # fmt: skip
    lines.append("print('ok')")
    proc = _python("\n".join(lines))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_names_that_did_not_move_are_left_alone():
    assert moved_name("fl_lightning.algorithms") is None and moved_name("fl_lightning") is None
    assert moved_name("somewhere_else.module") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fl_lightning.no_such_module")


def test_a_pickle_naming_an_old_module_loads():
    """Checkpoints and caches pickled before the move name ``fl_lightning.<module>.<class>``."""
    for old, new in PAIRS:
        module = importlib.import_module(new)
        cls = next((v for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == new), None)
        if cls is not None:
            assert pickle.loads(f"c{old}\n{cls.__name__}\n.".encode()) is cls


def test_the_public_names_are_unchanged():
    assert fl_lightning.__all__ == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(fl_lightning, name).__name__ == name


def test_the_root_holds_no_flat_modules():
    """Only the package's ``__init__`` and the import-name table lie in ``fl_lightning/`` itself; every
    folder says in its ``__init__`` docstring what it is."""
    flat = sorted(p.name for p in (ROOT / "fl_lightning").glob("*.py"))
    assert flat == ["__init__.py", "package_names.py"]
    for folder in sorted(p for p in (ROOT / "fl_lightning").iterdir() if (p / "__init__.py").is_file()):
        init = (folder / "__init__.py").read_text()
        assert init.lstrip().startswith('"""'), folder.name


def test_the_repository_uses_the_new_names():
    """Code, configs, docs and tests name the new modules (the old names are for users' files; a line
    that checks an old name on purpose says ``# old name``)."""
    old = "|".join(m for modules in MOVED.values() for m in modules)
    if not old:
        pytest.skip("nothing moved")
    pattern = re.compile(rf"\bfl_lightning[./]({old})\b|^\s*from fl_lightning import ({old})\b")
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    skip = {"fl_lightning/package_names.py", "tests/test_layout.py"}
    offenders = [f"{f}: {line.strip()}" for f in files if f not in skip and (ROOT / f).is_file()
                 for line in (ROOT / f).read_text().splitlines() if pattern.search(line) and "# old name" not in line]  # fmt: skip
    assert offenders == []


def test_an_old_class_path_runs_end_to_end(tmp_path, monkeypatch):
    """A user's fit config written before the move: its class_paths name the old modules."""
    main = importlib.import_module(_now("fl_lightning.cli")).main
    config = tmp_path / "old_names.yaml"
    config.write_text(textwrap.dedent("""\
        base: quickstart
        trainer:
          max_steps: 2
          val_check_interval: 1
          logger: false
          callbacks:
            - class_path: fl_lightning.callbacks.GlobalCost
        model:
          local:
            steps: 1
        data:
          init_args:
            participation:
              class_path: fl_lightning.participation.UniformSampling
              init_args:
                clients_per_round: 2
        """))
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(config)])
    assert importlib.import_module("fl_lightning.callbacks").GlobalCost.__module__ == _now("fl_lightning.callbacks")


def test_python_m_with_the_old_name_runs_the_command():
    """Scripts that start ranks or runs with ``python -m fl_lightning.cli`` keep working."""
    for name in sorted({"fl_lightning.cli", _now("fl_lightning.cli")}):
        proc = subprocess.run([sys.executable, "-m", name, "--version"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.strip(), (name, proc.stderr[-2000:])

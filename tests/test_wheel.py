"""The installed package: a wheel built from this tree, installed into a fresh venv, runs the quickstart by
name from an empty folder that has a ``models`` package of its own (slow: marked ``wheel``, ~1 min)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("fl_lightning", "models", "datamodules", "configs", "setup.py", "pyproject.toml", "README.md")


def _run(args, cwd, env, check=True):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin folder, environment) of a fresh venv holding only the wheel; torch and the other
    dependencies come from this interpreter's site-packages (a .pth line; no download)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a clean copy: the build writes build/ and *.egg-info beside the sources
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copyfile
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", source, "-w", tmp / "dist"], tmp, env)
    (wheel,) = (tmp / "dist").glob("fl_lightning-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp, env)
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "_dependencies.pth").write_text("\n".join(deps) + "\n")  # appended after the venv's own packages
    return venv / "bin", {**env, "WANDB_MODE": "disabled"}


def _user_folder(tmp_path: Path) -> Path:
    user = tmp_path / "userproj"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("MINE = True\n")
    return user


@pytest.mark.wheel
def test_the_installed_wheel_runs_the_quickstart_by_name_beside_a_users_models_package(installed, tmp_path):
    bin_, env = installed
    user = _user_folder(tmp_path)
    env = {**env, "PYTHONPATH": str(user)}  # the user's own `models` is importable, as in their scripts
    where = _run([bin_ / "python", "-c", "import fl_lightning, models; print(fl_lightning.__file__); print(models.__file__)"], user, env)
    package, user_models = where.stdout.split()
    assert Path(package).is_relative_to(bin_.parent) and Path(user_models) == user / "models" / "__init__.py"

    proc = _run([bin_ / "fl-lightning", "fit", "--config", "quickstart", "--trainer.max_steps", "2",
                 "--trainer.val_check_interval", "2"], user, env)  # fmt: skip
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("FedAvg: 2 rounds in ") and "final val acc" in line, proc.stdout
    assert (user / "runs" / "quickstart").is_dir() and not (user / "configs").exists()

    old = _run([bin_ / "fl-lightning", "fit", "--config", "quickstart", "--model.model", "models.SmallCNN"], user, env, check=False)
    assert old.returncode == 2 and old.stderr.strip().splitlines() == [
        "fl-lightning: error: class_path models.SmallCNN: the bundled models are fl_lightning.models "
        "(a models package of your own is never shadowed); write fl_lightning.models.SmallCNN"
    ]


@pytest.mark.wheel
def test_the_installed_wheel_lists_and_copies_its_configs(installed, tmp_path):
    bin_, env = installed
    listing = _run([bin_ / "fl-lightning", "configs"], tmp_path, env).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    assert names == sorted(names) and "compare_quickstart" in names and "\nquickstart " in listing
    _run([bin_ / "fl-lightning", "configs", "--copy", "compare_quickstart", "mine"], tmp_path, env)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["compare_quickstart.yaml", "quickstart.yaml"]
    assert (tmp_path / "mine" / "quickstart.yaml").read_text() == (ROOT / "configs" / "quickstart.yaml").read_text()
    assert "\nbase: quickstart.yaml" in (tmp_path / "mine" / "compare_quickstart.yaml").read_text()  # the copy's base


@pytest.mark.wheel
def test_the_installed_wheel_keeps_the_old_module_names(installed, tmp_path):
    """The modules that moved into the package's folders import under their old flat names too."""
    bin_, env = installed
    code = ("import fl_lightning.module as old, fl_lightning.engine.module as new; assert old is new; "  # old name
            "from fl_lightning.callbacks import GlobalCost; print(GlobalCost.__module__)")  # old name
    assert _run([bin_ / "python", "-c", code], tmp_path, env).stdout.strip() == "fl_lightning.engine.callbacks"


@pytest.mark.wheel
@pytest.mark.parametrize("command", [["lora-fixture", "fx"], ["lora-fixture", "fx", "--instruction"], ["fixture", "cifar10", "--out", "fx", "--train", "20", "--test", "10"]], ids=" ".join)
def test_the_installed_wheel_runs_the_docs_fixture_commands_outside_the_checkout(installed, tmp_path, command):
    """Every offline fixture the docs show, from a user's folder (no repository on the path): one used to import
    the checkout's top-level ``datamodules`` and failed anywhere but the repository's root."""
    bin_, env = installed
    proc = _run([bin_ / "fl-lightning", *command], tmp_path, env)
    assert (tmp_path / "fx").is_dir() and any((tmp_path / "fx").iterdir()), proc.stdout

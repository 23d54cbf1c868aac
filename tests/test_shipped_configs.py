"""Every shipped config selects on validation data and names the bundled packages by their installed names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fl_lightning.run.bundled_configs import configs_dir, find, resolve

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
OBJECTIVE_BENCHMARKS = {"svrg_least_squares", "fedavg_inv_sqrt_least_squares"}  # report f(theta); nothing is selected
# Clients of 1-2 samples: a per-client validation share rounds down to nothing (the config says so).
SCALE_DEMOS = {"large_population"}


def _chain(path: Path) -> list[dict]:
    raw = yaml.safe_load(path.read_text())
    base = raw.get("base")
    return ([] if base is None else _chain(find(base) or path.parent / base)) + [raw]


def _fit_configs() -> list[Path]:
    return [p for p in CONFIGS if not {"runs", "methods"} & set(yaml.safe_load(p.read_text()))]  # no sweep, no tuning study


@pytest.mark.parametrize("path", _fit_configs(), ids=lambda p: p.stem)
def test_every_fit_config_has_a_validation_split(path):
    chain = [c for c in _chain(path) if c.get("data")]
    if path.stem in OBJECTIVE_BENCHMARKS or any(c.get("base") in {f"{b}.yaml" for b in OBJECTIVE_BENCHMARKS} for c in _chain(path)):
        pytest.skip("an optimization benchmark")
    if path.stem in SCALE_DEMOS:
        pytest.skip("a scale demonstration whose clients are too small to hold out validation data")
    fractions = [c["data"].get("init_args", {}).get("val_fraction") for c in chain if "val_fraction" in c["data"].get("init_args", {})]
    assert fractions and 0 < fractions[-1] < 1, f"{path.name}: no data.init_args.val_fraction in it or its bases"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_configs_name_the_installed_packages_and_bundled_bases(path):
    text = path.read_text()
    assert not re.findall(r"(?<![\w.])(?:models|datamodules)\.[A-Z]", text), "write fl_lightning.models./fl_lightning.datamodules."
    base = yaml.safe_load(text).get("base")
    assert base is None or find(base) is not None, f"base {base} of {path.name} is not a bundled config"


def test_configs_are_found_by_name():
    assert configs_dir() == ROOT / "configs"
    assert find("quickstart") == find("quickstart.yaml") == find("configs/quickstart.yaml") == ROOT / "configs" / "quickstart.yaml"
    assert find("nope") is None and find("../quickstart") is None
    assert resolve("quickstart") == str(ROOT / "configs" / "quickstart.yaml") and resolve("nope.yaml") == "nope.yaml"


def test_a_base_by_name_resolves_to_the_bundled_config(tmp_path, monkeypatch):
    from fl_lightning.run.config_files import expand_bases

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("base: quickstart\nmodel: {local: {lr: 0.02}}\n")
    assert expand_bases(["fit", "--config", "mine.yaml"]) == [
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", "mine.yaml"]  # fmt: skip


def test_a_missing_config_is_one_line_before_lightning_is_imported(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom fl_lightning.commands.cli import main\ntry:\n    main(['fit', '--config', 'quickstrat'])\n"
            "except SystemExit as e:\n    print(e.code, 'lightning' in sys.modules, 'torch' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "fl-lightning: error: --config quickstrat: no such file, and no bundled config of that name; did you mean quickstart?"
    ]


def test_copy_writes_the_config_and_its_bases_building_on_the_copies(tmp_path, capsys):
    from fl_lightning.commands.cli import main

    main(["configs", "--copy", "fedprox_digits", str(tmp_path / "mine")])
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["fedprox_digits.yaml", "quickstart.yaml"]
    copied = yaml.safe_load((tmp_path / "mine" / "fedprox_digits.yaml").read_text())
    assert copied["base"] == "quickstart.yaml"
    main(["configs"])
    listing = capsys.readouterr().out
    assert "\nquickstart " in listing and "FedAvg on scikit-learn's bundled digits" in listing


@pytest.mark.parametrize("path", [p for p in _fit_configs() if p.stem not in OBJECTIVE_BENCHMARKS | SCALE_DEMOS], ids=lambda p: p.stem)
def test_every_offline_fit_config_validates_on_a_nonempty_split(path):
    """The split as the data module builds it (the YAML's fraction can floor to nothing on small clients)."""
    from fl_lightning.commands.cli import build_cli

    chain = _chain(path)
    dataset = next((c["data"]["init_args"]["dataset"] for c in reversed(chain) if "dataset" in c.get("data", {}).get("init_args", {})), None)
    if dataset not in ("digits", "synthetic"):
        pytest.skip(f"dataset {dataset!r} is not available offline")
    cli = build_cli(["--config", str(path), "--trainer.logger", "false"], run=False)
    cli.datamodule.setup()
    assert len(cli.datamodule.validation_indices) > 0


def test_copy_of_a_second_config_keeps_the_identical_shared_base(tmp_path, capsys):
    from fl_lightning.commands.cli import main

    main(["configs", "--copy", "pfl_ditto_digits", str(tmp_path / "mine")])
    main(["configs", "--copy", "pfl_fedrep_digits", str(tmp_path / "mine")])  # the same base beside it: kept
    assert "kept" in capsys.readouterr().out and (tmp_path / "mine" / "pfl_fedrep_digits.yaml").is_file()
    (tmp_path / "mine" / "pfl_digits.yaml").write_text("# edited\n")
    with pytest.raises(SystemExit) as stop:
        main(["configs", "--copy", "pfl_apfl_digits", str(tmp_path / "mine")])
    assert stop.value.code == 2 and "pfl_digits.yaml exists and differs" in capsys.readouterr().err

"""Every sweep in configs/ resolves, and each run's label names the algorithm the run trains.

A run's algorithm is the last ``model.algorithm`` among the base config, the sweep's
``overrides`` and the run's own keys (the order ``fl_lightning.experiments.sweep.run_args`` passes them).
A label must start with an algorithm name (``FedAvg-Dir0.1``, ``Scaffold-P K=5``,
``FedIT-AdamGT``); ``LABEL_PREFIXES`` maps those names to the classes of ``fl_lightning.algorithms``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import fl_lightning.algorithms as algorithms
from fl_lightning.experiments.sweep import load_sweep

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SWEEPS = sorted(CONFIGS.rglob("*sweep*.yaml"))

#: Label prefix (lower case) -> algorithm class name. The longest prefix that ends at a
#: non-alphanumeric character wins, so "FedAvg-P" is FedAvgP and "FedAvg-Dir0.1" is FedAvg.
LABEL_PREFIXES = {
    "fedavg": "FedAvg",
    "fedavgm": "FedAvgM",
    "fedavg-svrg": "FedAvgSVRG",
    "fedavgsvrg": "FedAvgSVRG",
    "fedavg-p": "FedAvgP",
    "fedavgp": "FedAvgP",
    "fedsim": "FedSim",
    "fedalt": "FedAlt",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "scaffold-p": "ScaffoldP",
    "scaffoldp": "ScaffoldP",
    "feddyn": "FedDyn",
    "fedsam": "FedSAM",
    "fedcm": "FedCM",
    "fedmim": "FedMIM",
    "fedadam": "FedAdam",
    "fedyogi": "FedYogi",
    "localadam": "LocalAdam",
    "fedlada": "FedLADA",
    "fadamet": "FAdamET",
    "fadamgt": "FAdamGT",
    # FedIT (LoRA adapters) with the FAdam paper's names: docs/algorithms.md, section 16
    "fedit-adam": "LocalAdam",
    "fedit-adamet": "FAdamET",
    "fedit-adamgt": "FAdamGT",
}


def label_algorithm(label: str) -> str | None:
    """The algorithm class a run label names, or None if it starts with no known name."""
    text = label.strip().lower()
    matches = [
        prefix
        for prefix in LABEL_PREFIXES
        if text.startswith(prefix) and (len(text) == len(prefix) or not text[len(prefix)].isalnum())
    ]
    return LABEL_PREFIXES[max(matches, key=len)] if matches else None


def _class_name(value) -> str | None:
    """``model.algorithm`` as written in YAML or a sweep key: a class path string or {class_path: ...}."""
    if isinstance(value, dict):
        value = value.get("class_path")
    return value.rsplit(".", 1)[-1] if isinstance(value, str) else None


def _algorithm_in(keys: dict) -> str | None:
    for key in ("model.algorithm", "model.algorithm.class_path"):
        if key in keys and _class_name(keys[key]):
            return _class_name(keys[key])
    return None


def run_algorithms(path: Path) -> dict[str, str | None]:
    """Run label -> the algorithm class name the run trains."""
    sweep = load_sweep(path)
    with open(sweep.base) as f:
        base = _class_name(((yaml.safe_load(f) or {}).get("model") or {}).get("algorithm"))
    default = _algorithm_in(sweep.overrides) or base
    return {name: _algorithm_in(keys) or default for name, keys in sweep.runs.items()}


def test_there_are_sweeps_to_check():
    assert len(SWEEPS) >= 10, SWEEPS


@pytest.mark.parametrize("path", SWEEPS, ids=[str(p.relative_to(CONFIGS)) for p in SWEEPS])
def test_every_run_label_names_the_algorithm_it_runs(path):
    for label, runs in run_algorithms(path).items():
        assert runs is not None and hasattr(algorithms, runs), f"{path.name}: run {label!r} has no known algorithm ({runs})"
        named = label_algorithm(label)
        assert named is not None, f"{path.name}: run label {label!r} starts with no algorithm name"
        assert named == runs, f"{path.name}: run {label!r} is labelled {named} but runs {runs}"


@pytest.mark.parametrize(
    "label, expected",
    [
        ("FedAvg", "FedAvg"),
        ("FedAvg-Dir0.1", "FedAvg"),
        ("FedAvg K=1", "FedAvg"),
        ("FedAvg-P K=5", "FedAvgP"),
        ("FedAvgM-lr0.01", "FedAvgM"),
        ("FedAvgSVRG (5, 2)", "FedAvgSVRG"),
        ("Scaffold-P m=3", "ScaffoldP"),
        ("SCAFFOLD-IID", "SCAFFOLD"),
        ("FedIT-Adam", "LocalAdam"),
        ("FedIT-AdamGT", "FAdamGT"),
        ("FedAvgPlus", None),
        ("Baseline", None),
    ],
)
def test_label_prefixes_tell_fedavg_from_its_variants(label, expected):
    assert label_algorithm(label) == expected


def test_a_mislabelled_run_is_caught(tmp_path):
    """The check can fail: FedMIM runs under a FedAvg label (the base config trains FedMIM)."""
    sweep = tmp_path / "bad_sweep.yaml"
    sweep.write_text(
        f"base: {CONFIGS / 'fedmim_cifar10.yaml'}\n"
        "runs:\n  FedAvg-IID:\n    data.init_args.partition: {class_path: datamodules.IID}\n"
    )
    assert run_algorithms(sweep) == {"FedAvg-IID": "FedMIM"}
    assert label_algorithm("FedAvg-IID") == "FedAvg"

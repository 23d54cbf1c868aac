"""scripts/state_snapshot.py compare: equal dumps pass, one differing bit fails, legacy personal keys map."""

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("state_snapshot", ROOT / "scripts" / "state_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_finds_a_single_differing_value_and_maps_legacy_personal_keys(tmp_path):
    snapshot = _script()
    old, same, changed = tmp_path / "old", tmp_path / "same", tmp_path / "changed"
    for folder in (old, same, changed):
        folder.mkdir()
    w = torch.arange(6.0)
    torch.save({"model/w": w, "personal/3/v/head": torch.ones(2)}, old / "run.pt")
    torch.save({"model/w": w.clone(), "client/3/personal/head": torch.ones(2)}, same / "run.pt")
    torch.save({"model/w": w.clone().index_fill_(0, torch.tensor([5]), 5.000001), "client/3/personal/head": torch.ones(2)},
               changed / "run.pt")  # fmt: skip
    assert snapshot.compare(old, same) == 0
    assert snapshot.compare(old, changed) == 1

"""`fl-lightning partition`: the label distribution of every client of a config's split."""

import csv
from pathlib import Path

import pytest

from fl_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _counts(path: Path) -> list[list[int]]:
    with open(path) as f:
        return [[int(v) for v in row[1:-1]] for row in list(csv.reader(f))[1:]]


def test_partition_draws_every_client_and_follows_the_seed(tmp_path, capsys):
    main(["partition", "--config", QUICKSTART, "--out", str(tmp_path / "s0.png")])
    main(["partition", "--config", QUICKSTART, "--out", str(tmp_path / "s1.png"), "--seed_everything", "1"])
    assert (tmp_path / "s0.png").stat().st_size > 5000 and "20 clients, 10 classes" in capsys.readouterr().out
    s0, s1 = _counts(tmp_path / "s0.csv"), _counts(tmp_path / "s1.csv")
    assert len(s0) == 20 and all(len(row) == 10 for row in s0)
    assert sum(map(sum, s0)) == sum(map(sum, s1))  # every training sample of digits, once
    assert s0 != s1  # another seed, another split
    assert all(sum(row) >= 10 for row in s0)  # Dirichlet min_size: 10


def test_partition_out_must_be_a_png(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["partition", "--config", QUICKSTART, "--out", str(tmp_path / "p.jpg")])
    assert exit_.value.code == 2 and "partition --out must be a .png" in capsys.readouterr().err

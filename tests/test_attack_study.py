"""scripts/attack_study.py: the sweeps it writes are valid compare sweeps with every attack x defence, and its
table reads the runs' final test accuracy and backdoor success (mean ± std over seeds)."""

from __future__ import annotations

import importlib.util

from fl_lightning.experiments.sweep import dir_name, load_sweep
from tests.test_cli import ROOT

spec = importlib.util.spec_from_file_location("attack_study", ROOT / "scripts" / "attack_study.py")
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def test_the_sweeps_hold_every_attack_against_every_defence(tmp_path):
    study.main(["--out", str(tmp_path), "--defences", "none", "median", 'krum:{"f": 2}', "--dry-run", "--seeds", "0", "1"])
    for partition, value in study.PARTITIONS.items():
        sweep = load_sweep(tmp_path / f"{partition}_sweep.yaml")
        assert len(sweep.runs) == len(study.ATTACKS) * 3 and sweep.seeds == [0, 1]
        assert sweep.overrides["data.init_args.partition"] == value
        alie = sweep.runs['ALIE | krum {"f": 2}']
        assert alie["model.robust"] == {"rule": "krum", "f": 2}
        assert sweep.runs["ALIE | median"]["model.robust"] == {"rule": "median", "fraction": 0.2}
        assert alie["model.attack"]["init_args"]["fraction"] == 0.2 and alie["model.attack"]["init_args"]["upload"]["class_path"].endswith(".ALIE")
        assert "model.robust" not in sweep.runs["ALIE | none"]
        assert sweep.runs["none | none"]["model.attack"]["init_args"]["fraction"] == 0.0


def test_the_table_is_the_mean_and_std_of_the_final_values(tmp_path):
    for seed, (acc, asr) in enumerate([(0.8, 0.5), (0.9, 0.7)]):
        run = tmp_path / "iid" / "runs" / dir_name("backdoor | none") / f"seed{seed}"
        run.mkdir(parents=True)
        run.joinpath("metrics.csv").write_text(f"round,test/acc,attack/backdoor_asr\n0,0.1,0.0\n1,{acc},{asr}\n")
    study.report(tmp_path, ["none"], [0, 1])
    rows = (tmp_path / "table.md").read_text().splitlines()
    assert "| iid | backdoor | none | 85.0 ± 7.1 | 60.0 ± 14.1 |" in rows
    assert "| iid | label flip | none | – | – |" in rows and (tmp_path / "heatmap.png").is_file()

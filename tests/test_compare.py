"""`fl-lightning compare`: a sweep of two tiny configs x two seeds gives plots, CSVs and tables
whose numbers are the run logs' numbers; the sweep file is validated before anything trains."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from fl_lightning.engine.callbacks import target_key
from fl_lightning.commands.cli import main
from fl_lightning.experiments.compare import INFO, run_one
from fl_lightning.experiments.history import History
from fl_lightning.experiments.sweep import load_sweep

BASE = {
    "seed_everything": 0,
    "trainer": {
        "max_steps": 6,
        "val_check_interval": 2,
        "check_val_every_n_epoch": None,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    },
    "model": {
        "model": {"class_path": "models.MLP", "init_args": {"in_features": 8, "num_classes": 3, "hidden": [16]}},
        "local": {"lr": 0.1, "steps": 3, "batch_size": 8},
    },
    "data": {
        "class_path": "datamodules.FederatedDataModule",
        "init_args": {
            "dataset": "synthetic",
            "dataset_args": {"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1},
            "num_clients": 6,
            "partition": {"class_path": "datamodules.Dirichlet", "init_args": {"alpha": 0.5, "min_size": 5}},
            "participation": {"class_path": "fl_lightning.core.participation.UniformSampling", "init_args": {"clients_per_round": 3}},
        },
    },
}


def write_sweep(tmp_path: Path, **changes) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    sweep = {
        "base": str(tmp_path / "base.yaml"),
        "seeds": [0, 1],
        "runs": {"K=3": {}, "K=1 lr=0.3": {"model.local.steps": 1, "model.local.lr": 0.3}},
        "targets": [0.4, 0.999],
        **changes,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def logged(run_dir: Path, column: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r.get(column)]


def test_compare_writes_plots_and_tables_with_the_logged_numbers(tmp_path):
    sweep_path = write_sweep(tmp_path)
    out = tmp_path / "out"
    main(["compare", "--config", str(sweep_path), "--out", str(out)])

    for name in ("acc_vs_rounds", "acc_vs_comm_per_client", "acc_vs_client_uploads", "acc_vs_bytes", "train_loss", "train_consistency"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
        assert (out / "plots" / f"{name}.csv").is_file()
    assert (out / "overview.png").is_file()
    runs = {"K=3": out / "runs" / "K=3", "K=1 lr=0.3": out / "runs" / "K=1_lr=0.3"}

    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))

    def summary(row: str, run: str, target: str = "") -> list[float]:
        hits = [r for r in rows if r["row"] == row and r["run"] == run and r["target"] == target]
        return [float(r["value"]) for r in sorted(hits, key=lambda r: int(r["seed"]))]

    md = (out / "summary.md").read_text()
    for run, run_root in runs.items():
        seeds = [run_root / "seed0", run_root / "seed1"]
        accs = [logged(s, "val/acc") for s in seeds]
        assert all(len(a) == 3 for a in accs)  # evaluations after rounds 2, 4, 6
        final = [a[-1] for a in accs]
        # no validation split in BASE: val/acc is the test set, and the rows say so
        assert summary("Test accuracy, global model, final evaluation", run) == final
        assert summary("Test accuracy, global model, best evaluation (selected on the test set)", run) == [max(a) for a in accs]
        assert f"{100 * np.mean(final):.1f} ± {100 * np.std(final, ddof=1):.1f}" in md  # percentages, 1 decimal

        # rounds to 0.4: the table equals what the TargetAccuracy callback logged during the runs
        callback_rounds = [logged(s, target_key(0.4)) for s in seeds]
        table_rounds = summary("Total global iterations (rounds)", run, "0.4")
        expected = [next(2.0 * (i + 1) for i, a in enumerate(acc) if a >= 0.4) if max(acc) >= 0.4 else 6.0 for acc in accs]
        assert table_rounds == expected
        assert [c[0] if c else 6.0 for c in callback_rounds] == expected
        assert not any(logged(s, target_key(0.999)) for s in seeds)
        # FedAvg sends one model down and one up per participating client and round
        assert summary("Total communication per client (model-sized messages)", run, "0.4") == [2 * r for r in expected]
        assert summary("Client uploads (total)", run, "0.4") == [3 * r for r in expected]
        never = summary("Total global iterations (rounds)", run, "0.999")
        assert never == [6.0, 6.0]

        # the plotted mean/std at each evaluation round are the seeds' logged accuracies
        with open(out / "plots" / "acc_vs_rounds.csv") as f:
            plotted = [r for r in csv.DictReader(f) if r["run"] == run]
        assert [float(r["round"]) for r in plotted] == [2.0, 4.0, 6.0]
        for i, r in enumerate(plotted):
            assert float(r["val/acc mean"]) == pytest.approx(np.mean([a[i] for a in accs]), abs=1e-12)
            assert float(r["val/acc std"]) == pytest.approx(np.std([a[i] for a in accs], ddof=1), abs=1e-12)
    assert "| Total global iterations (rounds) | 0.999 | >6.0 | >6.0 |" in md
    assert "| Wall time (s) |" in md and "| Seeds finished |" not in md and "## Failures" not in md  # no failures
    tex = (out / "summary.tex").read_text()
    assert "\\toprule" in tex and "$\\pm$" in tex and "Test accuracy, global model, final evaluation (\\%)" in tex

    # --reuse: a finished run with the same arguments is not trained again
    info = out / "runs" / "K=3" / "seed0" / INFO
    before = info.stat().st_mtime_ns
    assert run_one(load_sweep(sweep_path), "K=3", 0, out, reuse=True)["rounds"] == 6
    assert info.stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"algorithms": {}}, r"unknown key\(s\) \['algorithms'\]"),
        ({"runs": {}}, "runs must be a non-empty mapping"),
        ({"seeds": []}, "seeds must be a non-empty list"),
        ({"seeds": [0, -1]}, "seeds must be integers >= 0"),
        ({"seeds": [1, 1]}, "seeds must be distinct"),
        ({"seeds": [0.5]}, "seeds must be integers >= 0"),
        ({"targets": [80]}, r"targets must be a list of accuracies in \(0, 1\]"),
        ({"base": "no/such.yaml"}, "base config 'no/such.yaml' not found"),
        ({"overrides": {"seed_everything": 3}}, "seed_everything is set by compare"),
        ({"runs": {"a": {"trainer.logger": "x"}}}, r"runs.a: trainer.logger is set by compare"),
        ({"runs": {"a": {"not a key": 1}}}, "is not a dotted CLI key"),
        ({"runs": {"a b": {}, "a_b": {}}}, "share the directory name"),
        ({"scatter": ["K=3", "K=2"]}, "scatter must name two different runs of"),
    ],
)
def test_bad_sweep_files_are_rejected_with_the_setting_named(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        load_sweep(write_sweep(tmp_path, **changes))


def test_the_shipped_sweep_files_are_valid():
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*sweep*.yaml")) + [
        Path(__file__).resolve().parents[1] / "configs" / "compare_quickstart.yaml"
    ]:
        sweep = load_sweep(path)
        assert sweep.base.is_file() and sweep.runs and sweep.targets, path


def test_compare_cli_reports_bad_sweeps_in_one_line_and_fail_fast_stops_on_a_bad_run_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(write_sweep(tmp_path, seeds=[])), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert "fl-lightning: error: sweep" in capsys.readouterr().err
    # --fail-fast: a bad value inside a run fails before any run trains
    bad = write_sweep(tmp_path, runs={"ok": {}, "bad": {"model.local.lr": -1.0}})
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(bad), "--out", str(tmp_path / "o"), "--fail-fast"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "local.lr must be > 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "runs").exists()


def test_a_diverging_run_and_a_bad_config_are_recorded_the_sweep_goes_on_and_the_exit_code_says_so(tmp_path, capsys):
    sweep = write_sweep(
        tmp_path,
        seeds=[0],
        runs={
            "diverges": {"model.local.lr": 1.0e12},  # NaN/Inf after the first round: DivergenceError
            "bad config": {"model.algorithm": {"class_path": "fl_lightning.algorithms.FedProx", "init_args": {"mu": -1}}},
            "typo": {"model.local.no_such_key": 1},  # a jsonargparse error, not a ValueError
            "ok": {},
        },
    )
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(sweep), "--out", str(out)])
    assert exit_.value.code == 2  # a failure is bad input (an invalid run config)
    printed = capsys.readouterr().out
    assert "[compare] ok seed 0: global model at the final evaluation: test acc " in printed  # the next run still happened
    assert "(no validation split)" in printed
    # each failure once on the terminal; the final table says "failed" / "diverged", not the error
    assert printed.count("diverged at round 0") == 1
    assert printed.count("mu must be >= 0") == 1 and "[compare] bad config: failed: " in printed
    assert printed.count("no_such_key") == 1 and "[compare] typo: failed: " in printed
    final_printed = next(line for line in printed.splitlines() if line.startswith("| Test accuracy, global model, final"))
    assert final_printed.split(" | ")[1:4] == ["diverged", "failed", "failed"]
    assert "exit code 2" in printed and "--allow-failures" in printed
    infos = {name: json.loads((out / "runs" / d / "seed0" / INFO).read_text())
             for name, d in (("diverges", "diverges"), ("ok", "ok"), ("typo", "typo"))}  # fmt: skip
    assert infos["diverges"]["status"] == "diverged" and infos["ok"]["status"] == "ok"
    assert infos["typo"]["status"] == "failed" and infos["typo"]["bad_input"] is True
    md = (out / "summary.md").read_text()
    failures = md.split("## Failures", 1)[1]
    for text in ("diverged at round 0", "no_such_key", "mu must be >= 0"):
        assert md.count(text) == 1 and text in failures
    final_row = next(line for line in md.splitlines() if line.startswith("| Test accuracy, global model, final"))
    assert final_row.split(" | ")[1:4] == ["diverged", "failed", "failed"]  # no numbers, no error text
    assert (out / "overview.png").is_file() and (out / "summary.tex").is_file()
    # --report-only judges the same runs the same way; --allow-failures opts out
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(sweep), "--out", str(out), "--report-only"])
    assert exit_.value.code == 2
    main(["compare", "--config", str(sweep), "--out", str(out), "--report-only", "--allow-failures"])


def test_every_run_failing_exits_1_unless_failures_are_allowed(tmp_path, capsys):
    sweep = write_sweep(tmp_path, seeds=[0, 1], runs={"diverges": {"model.local.lr": 1.0e12}})
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(sweep), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 1
    printed = capsys.readouterr().out
    assert printed.count("diverged at round 0") == 2  # once per seed
    main(["compare", "--config", str(sweep), "--out", str(tmp_path / "out"), "--allow-failures"])
    assert "2 of 2 runs failed or diverged" in capsys.readouterr().out


def test_the_progress_line_and_the_tables_name_validation_and_test(tmp_path, capsys):
    sweep = write_sweep(tmp_path, seeds=[0], runs={"split": {"data.init_args.val_fraction": 0.2}}, targets=[0.4])
    out = tmp_path / "out"
    main(["compare", "--config", str(sweep), "--out", str(out)])
    val, test = logged(out / "runs" / "split" / "seed0", "val/acc"), logged(out / "runs" / "split" / "seed0", "test/acc")
    # the test set at every evaluation, then the final model's test after fit (as `fit` runs it): the same model
    assert len(val) == 3 and len(test) == 4 and test[-1] == test[-2]
    printed = capsys.readouterr().out
    assert printed.count("1 seed, no spread") == 1 and "±" not in printed  # the printed table says it too
    line = next(line for line in printed.splitlines() if line.startswith("[compare] split seed 0: global"))
    assert (f"global model at the final evaluation: validation acc {100 * val[-1]:.1f}%, test acc {100 * test[-1]:.1f}% · "
            f"best validation acc {100 * max(val):.1f}%") in line  # fmt: skip
    md = (out / "summary.md").read_text()
    assert f"| Test accuracy, global model, final evaluation (%) | {100 * test[-1]:.1f} |" in md
    assert f"| Validation accuracy, global model, final evaluation (%) | {100 * val[-1]:.1f} |" in md
    assert "## Cost to reach a target validation accuracy (global model" in md
    assert "## Cost to reach a target test accuracy (global model" in md
    assert md.count("1 seed, no spread") == 1 and "±" not in md


def test_fail_fast_stops_at_the_first_diverging_run(tmp_path, capsys):
    sweep = write_sweep(tmp_path, seeds=[0], runs={"diverges": {"model.local.lr": 1.0e12}, "ok": {}})
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--config", str(sweep), "--out", str(tmp_path / "out"), "--fail-fast"])
    assert exit_.value.code == 1
    assert "diverged at round 0" in capsys.readouterr().out
    assert not (tmp_path / "out" / "runs" / "ok").exists()


def test_grid_expands_every_run_over_every_combination(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, runs={"A": {}, "B": {"model.local.steps": 1}},
                                   grid={"model.local.lr": [0.01, 0.1], "model.local.batch_size": [8]}))  # fmt: skip
    assert list(sweep.runs) == ["A lr=0.01 batch_size=8", "A lr=0.1 batch_size=8",
                                "B lr=0.01 batch_size=8", "B lr=0.1 batch_size=8"]  # fmt: skip
    assert sweep.runs["B lr=0.1 batch_size=8"] == {"model.local.steps": 1, "model.local.lr": 0.1, "model.local.batch_size": 8}
    with pytest.raises(ValueError, match="grid.model.local.lr must be a non-empty list"):
        load_sweep(write_sweep(tmp_path, grid={"model.local.lr": 0.1}))


def test_history_merges_training_and_evaluation_rows(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "comm/bytes_total,comm/client_uploads_total,round,step,val/acc\n"
        "10,1,1,0,\n20,2,2,1,\n,,,1,0.5\n"
    )
    history = History.from_csv(tmp_path / "metrics.csv", model_bytes=5)
    assert history.records[1] == {  # the columns' old names read as today's; round = rounds completed
        "comm/cumulative_bytes": 20.0,
        "comm/cumulative_client_uploads": 2.0,
        "round": 2.0,
        "val/acc": 0.5,
        "comm/per_client_total": 4.0,
    }
    assert math.isnan(History().final())


def test_sweep_wandb_key_adds_a_wandb_logger_next_to_the_csv_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from fl_lightning.experiments.compare import _build
    from fl_lightning.experiments.sweep import run_args

    sweep = load_sweep(write_sweep(tmp_path, wandb={"project": "fl-test", "offline": True}))
    cli = _build(run_args(sweep, "K=1 lr=0.3", 1, tmp_path / "out"))
    csv_logger, wandb = cli.trainer.loggers
    assert isinstance(csv_logger, CSVLogger) and isinstance(wandb, WandbLogger)
    assert Path(csv_logger.log_dir) == tmp_path / "out" / "runs" / "K=1_lr=0.3" / "seed1"
    assert wandb._wandb_init["group"] == "K=1 lr=0.3" and wandb._wandb_init["project"] == "fl-test"
    assert wandb._wandb_init["job_type"] == "sweep" and wandb._wandb_init["name"] == "K=1 lr=0.3 seed1"
    assert cli.model.local.steps == 1 and cli.model.local.lr == 0.3 and cli.datamodule.seed == 1


def test_a_personalized_run_named_with_a_bar_is_reported_in_its_own_terms(tmp_path, capsys):
    """The per-run line and run_info carry the model each client predicts with (not only the global model), the
    overview draws it, and a run name with `|` (the attack study's "attack | defence") keeps the tables' columns; each
    client's final test accuracy from the runs' clients.csv is drawn per run and run against run, the share below 50 %
    tabulated."""
    from fl_lightning.experiments.compare import result_line
    from fl_lightning.experiments.plots import overview_panels

    sweep_path = write_sweep(tmp_path, seeds=[0], targets=[],
                             runs={"Ditto | lam": {"model.algorithm": {"class_path": "fl_lightning.algorithms.Ditto"},
                                                   "data.init_args.holdout_fraction": 0.3, "data.init_args.val_fraction": 0.2},
                                   "FedAvg": {"data.init_args.holdout_fraction": 0.3, "data.init_args.val_fraction": 0.2, "trainer.max_steps": 2}})  # fmt: skip
    out = tmp_path / "out"
    main(["compare", "--config", str(sweep_path), "--out", str(out)])
    info = json.loads((out / "runs" / "Ditto_lam" / "seed0" / INFO).read_text())
    assert set(info["personal"]) >= {"personal_acc_mean", "personal_acc_worst10"}  # the validation half, during training
    assert set(info["personal_test"]) >= {"personal_acc_mean", "personal_acc_worst10"}  # the test half, after it
    line = result_line("Ditto | lam", 0, info)
    assert "each client's own model, test half of its held-out data: mean" in line
    assert f"mean {100 * info['personal_test']['personal_acc_mean']:.1f}%" in line
    assert line in capsys.readouterr().out
    assert "val_personal_acc_mean" in overview_panels({"acc_vs_rounds": 1, "val_personal_acc_mean": 1})
    assert (out / "plots" / "val_personal_acc_mean.png").is_file()
    tables, lines = [[]], (out / "summary.md").read_text().splitlines()
    for line in lines:  # consecutive table lines form one table
        if line.startswith("|"):
            tables[-1].append(line.replace("\\|", ""))
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    assert any("Ditto" in line for t in tables for line in t)
    assert "Personalized accuracy at test (client holdout, test half, mean over clients)" in (out / "summary.md").read_text()
    assert all(len({line.count("|") for line in t}) == 1 for t in tables), tables
    assert "Ditto \\textbar{} lam" in (out / "summary.tex").read_text()


    # each client's final test accuracy from the runs' clients.csv: a box per run, and FedAvg against Ditto client by client
    final = {}
    for run, folder, last in (("Ditto | lam", "Ditto_lam", "5"), ("FedAvg", "FedAvg", "1")):
        rows = [r for r in read_csv(out / "runs" / folder / "seed0" / "clients.csv") if r["split"] == "test"]
        assert {r["round"] for r in rows} == {last} and len(rows) == 6  # the test of the final model, every client
        final[run] = {int(r["client"]): r for r in rows}
        drawn = [r for r in read_csv(out / "plots" / "clients_test_acc.csv") if r["run"] == run]
        assert [(int(r["client"]), float(r["personal_acc"])) for r in drawn] == [(c, float(r["personal_acc"])) for c, r in final[run].items()]
        share = float(logged(out / "runs" / folder / "seed0", "test/personal_acc_below50")[-1])
        assert share == float(np.float32(np.mean([float(r["personal_acc"]) < 0.5 for r in rows])))
        row = next(line for line in lines if line.startswith("| Share of clients below 50% accuracy at test"))
        assert f"{100 * share:.1f}" in row.replace("\\|", "").split("|")[2 if run != "FedAvg" else 3]
    assert all(r["global_acc"] == r["personal_acc"] for r in final["FedAvg"].values())  # FedAvg predicts with the global model
    assert any(r["global_acc"] != r["personal_acc"] for r in final["Ditto | lam"].values())
    pairs = read_csv(out / "plots" / "clients_scatter_Ditto_lam_vs_FedAvg.csv")
    assert [(int(p["client"]), float(p["Ditto | lam personal_acc"]), float(p["FedAvg personal_acc"])) for p in pairs] == [
        (c, float(final["Ditto | lam"][c]["personal_acc"]), float(final["FedAvg"][c]["personal_acc"])) for c in range(6)]
    assert (out / "plots" / "clients_test_acc.png").is_file() and (out / "plots" / "clients_scatter_Ditto_lam_vs_FedAvg.png").is_file()


def test_the_final_test_row_belongs_to_the_last_round(tmp_path):
    """The test stage logs at step N (after N rounds) with ``round`` N - 1: it is the last round's, not a round N + 1."""
    path = tmp_path / "metrics.csv"
    path.write_text("round,step,train/loss,val/acc,test/acc\n0.0,0,1.0,,\n1.0,1,0.5,0.8,\n1.0,1,,0.8,0.7\n1.0,2,,,0.75\n")
    history = History.from_csv(path)
    assert [r["round"] for r in history.records] == [1.0, 2.0]
    assert history.last("round") == 2.0 and history.final("test/acc") == 0.75

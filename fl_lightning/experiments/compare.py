"""``fl-lightning compare --config SWEEP.yaml --out DIR``: every run x seed of a sweep, then plots and tables.

Each run is an ordinary ``fl-lightning fit`` (same parser, same config file plus the
sweep's dotted keys), run in this process one after another and logged with a
CSVLogger to ``DIR/runs/<name>/seed<s>/`` (and wandb if the sweep asks). Then:
``DIR/plots/*.png`` + ``*.csv`` (mean ± std over seeds; from the runs' ``clients.csv``, each client's final
test accuracy per run and run against run), ``DIR/overview.png``,
``DIR/summary.md`` and ``DIR/summary.tex`` (accuracy, wall time, cost-to-target, each row naming
its split and model) and ``DIR/summary.csv`` (per seed). A run that fails or diverges is recorded
(``run_info.json``, the Failures section of ``summary.md``, the plot legends), printed once, and
the sweep goes on (``--fail-fast`` stops); compare then exits 1, or 2 when a run's config is invalid
(``--allow-failures``: 0).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from fl_lightning.experiments.history import History
from fl_lightning.experiments.sweep import Sweep, dir_name, load_sweep, run_args

INFO = "run_info.json"


def _build(args: list[str]):
    from fl_lightning.run.cli_app import build as build_cli

    return build_cli(args, run=False, exit_on_error=False)


def model_bytes(module: Any) -> int:
    """Bytes of the federated tensors: the size of one model-sized message."""
    return sum(p.numel() * p.element_size() for p in module.federated_parameters())


def describe_failure(error: BaseException) -> str:
    """One line for a failed run: ``diverged at round r`` or ``failed: <first line of the error>``."""
    from fl_lightning.core.errors import essential as _essential

    if type(error).__name__ == "DivergenceError":
        match = re.search(r"round (\d+)", str(error))
        return f"diverged at round {match.group(1)}" if match else "diverged"
    if isinstance(error, SystemExit):
        text = f"exited with code {error.code}"
    else:
        lines = [line.strip() for line in _essential(str(error)).splitlines() if line.strip()]
        text = lines[0] if lines else type(error).__name__
        if len(lines) > 1 and re.match(r"^(Parser key|Problem with given class_path)", text):
            text = lines[-1]  # jsonargparse: the key, then the reason on a later line
    text = re.sub(r"\s+", " ", text)
    return "failed: " + (text if len(text) <= 200 else text[:197] + "...")


def result_line(name: str, seed: int, info: dict[str, Any]) -> str:
    """The per-run line compare prints when a run finishes, naming the split and model of each accuracy:
    ``global model at the final evaluation: validation acc 80.0%, test acc 78.8% · best validation acc 81.0%``."""
    head = f"[compare] {name} seed {seed}:"
    if info.get("status", "ok") != "ok":
        rounds = info.get("rounds")
        return f"{head} {info['error']}" + (f" ({rounds} rounds done)" if rounds else "")
    parts = []
    if info.get("final_acc") is not None:
        split = info.get("acc_split")  # "validation", "test" (no validation split); absent in older run_info.json
        name_of = {"validation": "validation acc", "test": "test acc"}.get(split, "val/acc")
        final = f"global model at the final evaluation: {name_of} {100 * info['final_acc']:.1f}%"
        if info.get("final_test_acc") is not None:
            final += f", test acc {100 * info['final_test_acc']:.1f}%"
        parts.append(final + (" (no validation split)" if split == "test" else ""))
        parts.append(f"best {name_of} {100 * info['best_acc']:.1f}%")
    half = "test" if info.get("personal_test") else "validation"  # the test half once the final test ran
    personal = info.get("personal_test") or info.get("personal") or {}
    if "personal_acc_mean" in personal:  # a personalized method: the model each client predicts with
        parts.append(
            f"each client's own model, {half} half of its held-out data: mean {100 * personal['personal_acc_mean']:.1f}%, "
            f"worst 10% {100 * personal['personal_acc_worst10']:.1f}%"
        )
    if "unseen_acc_mean" in personal:
        parts.append(f"unseen clients {100 * personal['unseen_acc_mean']:.1f}%")
    parts.append(f"{info['rounds']} {info.get('unit', 'rounds')}" + (f" ({info['sim_s']:.1f} s simulated)" if info.get("sim_s") is not None else ""))
    parts.append(f"{info['fit_seconds']:.1f} s")
    return f"{head} " + " · ".join(parts + list(info.get("mechanisms", [])))


def _record(run_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / INFO).write_text(json.dumps(info, indent=1))
    return info


def run_one(
    sweep: Sweep, name: str, seed: int, out: Path, reuse: bool = False, config_error: str | None = None
) -> dict[str, Any]:
    """Train one run x seed (or reuse a finished one with identical arguments); returns its run_info.

    A run that raises (a ``DivergenceError``, any exception, a config error) is recorded in its
    ``run_info.json`` with ``status`` ``"diverged"`` or ``"failed"`` and a one-line ``error``;
    it does not raise. ``config_error``: the run's config is already known to be invalid.
    """
    run_dir = sweep.run_dir(out, name, seed)
    args = run_args(sweep, name, seed, out)
    info_path = run_dir / INFO
    if reuse and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("args") == args and info.get("status", "ok") == "ok" and (run_dir / "metrics.csv").is_file():
            print(f"[compare] {name} seed {seed}: reusing {run_dir}", flush=True)
            return info
    if run_dir.exists():
        shutil.rmtree(run_dir)
    info: dict[str, Any] = {"name": name, "seed": seed, "args": args, "status": "ok"}
    if config_error is not None:  # bad input: compare exits 2
        return _record(run_dir, {**info, "status": "failed", "error": config_error, "rounds": 0, "bad_input": True})
    print(f"[compare] {name} seed {seed}: training -> {run_dir}", flush=True)
    cli, start = None, time.perf_counter()
    try:
        cli = _build(args)
        start = time.perf_counter()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        from fl_lightning.run.cli_app import test_after_fit

        test_after_fit(cli.trainer, cli.model, cli.datamodule)  # as fit does: the test set and each client's test half
    except (Exception, SystemExit) as error:  # noqa: BLE001  (a failed run is a result of the sweep)
        text = describe_failure(error)
        info.update(status="diverged" if text.startswith("diverged") else "failed", error=text)
    finally:
        seconds = time.perf_counter() - start
        if cli is not None:
            for logger in cli.trainer.loggers:
                if type(logger).__name__ == "WandbLogger":
                    logger.experiment.finish(exit_code=0 if info["status"] == "ok" else 1)
    info["rounds"] = int(cli.trainer.global_step) if cli is not None else 0
    info["fit_seconds"] = round(seconds, 3)
    if cli is not None:
        info["model_bytes"] = model_bytes(cli.model)
        summary = next((c for c in cli.trainer.callbacks if type(c).__name__ == "RunSummary"), None)
        if summary is not None:
            info["unit"], info["sim_s"], info["mechanisms"] = summary.unit, summary.sim_s, summary.mechanisms
            if summary.personal:
                info["personal"] = dict(summary.personal)
        if summary is not None and summary.accuracies:  # val/acc: the validation split, else the test set
            info["final_acc"], info["best_acc"] = summary.final_acc, summary.best[1]
            split = bool(getattr(cli.datamodule, "val_fraction", 0))
            info["acc_split"] = "validation" if split else "test"
            test_acc = cli.trainer.callback_metrics.get("test/acc") if split else None
            if test_acc is not None:  # the test set at the last evaluation
                info["final_test_acc"] = float(test_acc)
            tested = {k: float(cli.trainer.callback_metrics[f"test/{k}"]) for k in ("personal_acc_mean", "personal_acc_worst10", "unseen_acc_mean")
                      if f"test/{k}" in cli.trainer.callback_metrics}  # fmt: skip
            if tested:
                info["personal_test"] = tested
    return _record(run_dir, info)


def _run_info(sweep: Sweep, out: Path, name: str, seed: int) -> dict[str, Any] | None:
    path = sweep.run_dir(out, name, seed) / INFO
    return json.loads(path.read_text()) if path.is_file() else None


def load_histories(sweep: Sweep, out: Path) -> dict[str, list[History]]:
    """Every run x seed's logged history; a failed run x seed without logs has an empty one."""
    histories = {}
    for name in sweep.runs:
        histories[name] = []
        for seed in sweep.seeds:
            run_dir = sweep.run_dir(out, name, seed)
            info = _run_info(sweep, out, name, seed)
            if info is None:
                raise ValueError(f"run {name!r} seed {seed} has no finished logs in {run_dir}; run compare without --report-only")
            if (run_dir / "metrics.csv").is_file():
                histories[name].append(History.from_csv(run_dir / "metrics.csv", info.get("model_bytes")))
            elif info.get("status", "ok") == "ok":
                raise ValueError(f"run {name!r} seed {seed} has no metrics.csv in {run_dir}; run compare without --report-only")
            else:
                histories[name].append(History())
    return histories


def load_statuses(sweep: Sweep, out: Path) -> tuple[dict[str, list[str | None]], dict[str, list[float | None]]]:
    """Per run and seed: None (finished) or the failure line, and the fit wall time."""
    statuses, seconds = {}, {}
    for name in sweep.runs:
        infos = [_run_info(sweep, out, name, seed) or {} for seed in sweep.seeds]
        statuses[name] = [None if i.get("status", "ok") == "ok" else i.get("error", "failed") for i in infos]
        seconds[name] = [i.get("fit_seconds") for i in infos]
    return statuses, seconds


def load_per_client(sweep: Sweep, out: Path, statuses: dict[str, list[str | None]]) -> tuple[dict, dict]:
    """Per run: the held-out accuracy of every client at each finished seed's last evaluation
    (``per_client_acc.csv`` of ``PerClientEvaluation``), pooled over seeds, and that round."""
    accuracies: dict[str, list[float]] = {}
    rounds: dict[str, float] = {}
    for name in sweep.runs:
        for seed, status in zip(sweep.seeds, statuses[name]):
            path = sweep.run_dir(out, name, seed) / "per_client_acc.csv"
            if status is not None or not path.is_file():
                continue
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            if not rows:
                continue
            last = max(float(r["round"]) for r in rows)
            accuracies.setdefault(name, []).extend(float(r["acc"]) for r in rows if float(r["round"]) == last)
            rounds[name] = last
    return accuracies, rounds


def load_client_records(sweep: Sweep, out: Path, statuses: dict[str, list[str | None]]) -> dict[str, list[dict[str, Any]]]:
    """Per run: every training client's row of each finished seed's final test evaluation (the last ``test`` round of its
    ``clients.csv``, ``PersonalizedEvaluation``), with its ``seed``; runs without such rows are left out."""
    from fl_lightning.engine.client_record import FILE

    records: dict[str, list[dict[str, Any]]] = {}
    for name in sweep.runs:
        for seed, status in zip(sweep.seeds, statuses[name]):
            path = sweep.run_dir(out, name, seed) / FILE
            if status is not None or not path.is_file():
                continue
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r["split"] == "test" and r["seen"] == "1"]
            if not rows:
                continue
            last = max(int(r["round"]) for r in rows)
            final = {int(r["client"]): r for r in rows if int(r["round"]) == last}  # a test run twice: its last rows
            records.setdefault(name, []).extend({"seed": seed, "client": cid, "round": last, "samples": int(r["samples"]),
                                                 "global_acc": float(r["global_acc"]), "personal_acc": float(r["personal_acc"])}
                                                for cid, r in sorted(final.items()))  # fmt: skip
    return records


def report(sweep: Sweep, out: Path) -> list[Path]:
    """Plots and tables from the logged runs in ``out/runs``."""
    from fl_lightning.experiments.plots import (
        plot_all,
        plot_client_records,
        plot_per_client,
    )
    from fl_lightning.experiments.tables import write_summary

    histories = load_histories(sweep, out)
    statuses, seconds = load_statuses(sweep, out)
    title = sweep.path.stem
    written = plot_all(histories, out, title, statuses=statuses)
    per_client, rounds = load_per_client(sweep, out, statuses)
    written += plot_per_client(per_client, out, title, rounds)
    written += plot_client_records(load_client_records(sweep, out, statuses), out, title, sweep.scatter)
    written += list(write_summary(histories, sweep.seeds, sweep.targets, out, title, statuses, seconds))
    return written


def print_summary(sweep: Sweep, out: Path) -> None:
    from fl_lightning.experiments.tables import first_table_markdown

    statuses, seconds = load_statuses(sweep, out)
    print(first_table_markdown(load_histories(sweep, out), sweep.seeds, statuses, seconds), flush=True)


def exit_code(sweep: Sweep, out: Path) -> int:
    """0 when every run x seed finished; 2 when a failed one had an invalid config (bad input); else 1."""
    infos = [_run_info(sweep, out, name, seed) or {} for name in sweep.runs for seed in sweep.seeds]
    failed = [i for i in infos if i.get("status", "ok") != "ok"]
    return 0 if not failed else 2 if any(i.get("bad_input") for i in failed) else 1


def _config_errors(sweep: Sweep, out: Path) -> dict[str, str]:
    """Every run's config parsed before anything trains: run name -> its config error."""
    from fl_lightning.run.cli_app import SeveralProcesses

    errors = {}
    for name in sweep.runs:
        try:
            _build(run_args(sweep, name, sweep.seeds[0], out))
        except SeveralProcesses:  # DDP: no run of the sweep can train (docs/cluster.md)
            raise
        except (Exception, SystemExit) as error:  # noqa: BLE001
            errors[name] = describe_failure(error)
    return errors


def compare(config: str | Path, out: str | Path, reuse: bool = False, fail_fast: bool = False) -> list[Path]:
    """Validate the sweep and every run's config, train all runs x seeds, write plots and tables.

    A run whose config is invalid, or that diverges or raises, is recorded and the sweep goes on;
    ``fail_fast`` stops at the first such run instead (a config error: before anything trains).
    """
    sweep, out = load_sweep(config), Path(out).resolve()
    errors = _config_errors(sweep, out)
    for name, error in errors.items():  # printed once here, not again per seed
        print(f"[compare] {name}: {error}", flush=True)
    if errors and fail_fast:
        name, error = next(iter(errors.items()))
        raise ValueError(f"sweep {sweep.path}: run {name!r} has an invalid config: {error.removeprefix('failed: ')}")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sweep.path, out / "sweep.yaml")
    failures = 0
    for name in sweep.runs:
        for seed in sweep.seeds:
            info = run_one(sweep, name, seed, out, reuse, config_error=errors.get(name))
            if name not in errors:
                print(result_line(name, seed, info), flush=True)
            if info.get("status", "ok") != "ok":
                failures += 1
                if fail_fast:
                    print(f"[compare] stopped at the first failure (--fail-fast): {name} seed {seed}", flush=True)
                    raise SystemExit(1)
    written = report(sweep, out)
    print("", flush=True)
    print_summary(sweep, out)
    total = len(sweep.runs) * len(sweep.seeds)
    failed = f"; {failures} of {total} runs failed or diverged (each printed above, listed under Failures in summary.md)" if failures else ""
    plots = sum(1 for p in written if p.suffix == ".png")
    print(f"\n[compare] wrote {out / 'summary.md'}, summary.tex and {plots} plots under {out}{failed}", flush=True)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fl-lightning compare",
        description="Run every run x seed of a sweep file, then write plots (PNG + CSV), summary.md and summary.tex into --out.",
    )
    parser.add_argument("--config", required=True, help="sweep YAML (base, seeds, overrides, grid, runs, targets, wandb)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--reuse", action="store_true", help="skip runs already finished in --out with the same arguments")
    parser.add_argument("--report-only", action="store_true", help="only redraw plots and tables from --out/runs")
    parser.add_argument(
        "--fail-fast", action="store_true", help="stop at the first failed or diverged run (default: record it and go on)"
    )
    parser.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even if a run failed or diverged (default: exit 1, or 2 when a run's config is invalid)",
    )
    ns = parser.parse_args(argv)
    if Path(ns.out).exists() and not Path(ns.out).is_dir():
        raise ValueError(f"--out {ns.out} is a file; give a folder (compare writes runs/, plots and summary.md into it)")
    sweep, out = load_sweep(ns.config), Path(ns.out).resolve()
    if ns.report_only:
        report(sweep, out)
        print_summary(sweep, out)
    else:
        compare(ns.config, ns.out, reuse=ns.reuse, fail_fast=ns.fail_fast)
    code = exit_code(sweep, out)
    if code and not ns.allow_failures:
        why = "a run's config is invalid" if code == 2 else "a run failed or diverged"
        print(f"[compare] exit code {code}: {why} (--allow-failures exits 0)", flush=True)
        raise SystemExit(code)


__all__ = ["compare", "describe_failure", "dir_name", "exit_code", "load_histories", "load_statuses", "main", "report", "run_one"]

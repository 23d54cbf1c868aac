"""``fl-lightning compare --config SWEEP.yaml --out DIR``: every run x seed of a sweep, then plots and tables.

Each run is an ordinary ``fl-lightning fit`` (same parser, same config file plus the
sweep's dotted keys), run in this process one after another and logged with a
CSVLogger to ``DIR/runs/<name>/seed<s>/`` (and wandb if the sweep asks). Then:
``DIR/plots/*.png`` + ``*.csv`` (mean ± std over seeds), ``DIR/overview.png``,
``DIR/summary.md`` (final accuracy, cost-to-target) and ``DIR/summary.csv`` (per seed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from fl_lightning.history import History
from fl_lightning.sweep import Sweep, dir_name, load_sweep, run_args

INFO = "run_info.json"


def _build(args: list[str]):
    from fl_lightning.cli import build_cli

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both args and sys.argv are given
    try:
        return build_cli(args, run=False)
    finally:
        sys.argv = argv


def model_bytes(module: Any) -> int:
    """Bytes of the federated tensors: the size of one model-sized message."""
    return sum(p.numel() * p.element_size() for p in module.federated_parameters())


def run_one(sweep: Sweep, name: str, seed: int, out: Path, reuse: bool = False) -> dict[str, Any]:
    """Train one run x seed (or reuse a finished one with identical arguments); returns its run_info."""
    run_dir = sweep.run_dir(out, name, seed)
    args = run_args(sweep, name, seed, out)
    info_path = run_dir / INFO
    if reuse and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("args") == args and (run_dir / "metrics.csv").is_file():
            print(f"[compare] {name} seed {seed}: reusing {run_dir}", flush=True)
            return info
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"[compare] {name} seed {seed}: training -> {run_dir}", flush=True)
    cli = _build(args)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - start
    for logger in cli.trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.experiment.finish()
    info = {
        "name": name,
        "seed": seed,
        "args": args,
        "model_bytes": model_bytes(cli.model),
        "rounds": int(cli.trainer.global_step),
        "fit_seconds": round(seconds, 3),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    info_path.write_text(json.dumps(info, indent=1))
    return info


def load_histories(sweep: Sweep, out: Path) -> dict[str, list[History]]:
    histories = {}
    for name in sweep.runs:
        histories[name] = []
        for seed in sweep.seeds:
            run_dir = sweep.run_dir(out, name, seed)
            info = json.loads((run_dir / INFO).read_text())
            histories[name].append(History.from_csv(run_dir / "metrics.csv", info.get("model_bytes")))
    return histories


def report(sweep: Sweep, out: Path) -> list[Path]:
    """Plots and tables from the logged runs in ``out/runs``."""
    from fl_lightning.plots import plot_all
    from fl_lightning.tables import write_summary

    histories = load_histories(sweep, out)
    title = sweep.path.stem
    written = plot_all(histories, out, title)
    written += list(write_summary(histories, sweep.seeds, sweep.targets, out, title))
    return written


def compare(config: str | Path, out: str | Path, reuse: bool = False) -> list[Path]:
    """Validate the sweep and every run's config, train all runs x seeds, write plots and tables."""
    sweep, out = load_sweep(config), Path(out).resolve()
    for name in sweep.runs:  # every run's config must parse before anything trains
        try:
            _build(run_args(sweep, name, sweep.seeds[0], out))
        except SystemExit as exit_:
            raise ValueError(f"sweep {sweep.path}: run {name!r} has an invalid config (see the message above)") from exit_
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sweep.path, out / "sweep.yaml")
    for name in sweep.runs:
        for seed in sweep.seeds:
            run_one(sweep, name, seed, out, reuse)
    written = report(sweep, out)
    print(f"[compare] wrote {out / 'summary.md'} and {len(written) - 2} plot files under {out}", flush=True)
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fl-lightning compare",
        description="Run every run x seed of a sweep file, then write plots (PNG + CSV) and summary.md into --out.",
    )
    parser.add_argument("--config", required=True, help="sweep YAML (base, seeds, overrides, runs, targets, wandb)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--reuse", action="store_true", help="skip runs already finished in --out with the same arguments")
    parser.add_argument("--report-only", action="store_true", help="only redraw plots and tables from --out/runs")
    ns = parser.parse_args(argv)
    if ns.report_only:
        report(load_sweep(ns.config), Path(ns.out).resolve())
    else:
        compare(ns.config, ns.out, reuse=ns.reuse)


__all__ = ["compare", "dir_name", "load_histories", "main", "report", "run_one"]

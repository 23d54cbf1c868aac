"""The sweep file of ``fl-lightning compare``: loading, validation, and each run's CLI arguments.

```yaml
base: configs/quickstart.yaml      # a fit config (absolute, or relative to the working
                                   # directory, the sweep file's directory or the repo root)
seeds: [0, 1, 2]                   # seed s sets seed_everything=s and data.init_args.seed=s
overrides:                         # dotted CLI keys applied to every run
  trainer.max_steps: 200
runs:                              # name -> dotted CLI keys of that run (may be empty)
  FedAvg: {}
  FedAvg K=1: {model.local.steps: 1}
grid:                              # optional: every run x every combination of these values,
  model.local.lr: [0.01, 0.03]     # named "<run> lr=0.01", ...
targets: [0.8, 0.9]                # accuracy targets: cost tables on validation (and test) accuracy
scatter: [FedAvg, FedAvg K=1]      # optional: the pair of runs whose per-client test accuracies are drawn
                                   # against each other (default: the first run against each other run)
wandb: {project: my-project}       # optional: also log every run to wandb (WandbLogger init_args;
                                   # group = run name, job_type = sweep file name, name = "<run> seed<s>")
```
Dict and list values are passed to the CLI as JSON.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


KEYS = ("base", "seeds", "overrides", "runs", "grid", "targets", "scatter", "wandb")
RESERVED = {  # set by compare itself for every run
    "seed_everything": "use `seeds`",
    "data.init_args.seed": "use `seeds`",
    "trainer.logger": "compare logs every run with a CSVLogger in OUT/runs/<name>/seed<s>; use `wandb` for wandb",
    "trainer.default_root_dir": "compare places every run in OUT/runs/<name>/seed<s>",
}
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Sweep:
    path: Path
    base: Path
    runs: dict[str, dict[str, Any]]
    seeds: list[int] = field(default_factory=lambda: [0])
    overrides: dict[str, Any] = field(default_factory=dict)
    targets: list[float] = field(default_factory=list)
    wandb: dict[str, Any] | None = None
    scatter: tuple[str, str] | None = None

    def run_dir(self, out: Path, name: str, seed: int) -> Path:
        return out / "runs" / dir_name(name) / f"seed{seed}"


def dir_name(name: str) -> str:
    """A run name as a directory name: anything but letters, digits, ``. = + -`` becomes ``_``;
    never ``.`` or ``..`` (a run directory always lies inside ``OUT/runs``)."""
    name = re.sub(r"[^\w.=+-]+", "_", name).strip("_")
    return name if name.strip(".") else "run"


def _error(path: Path, message: str) -> ValueError:
    return ValueError(f"sweep {path}: {message}")


def _check_keys(path: Path, where: str, mapping: Any) -> dict[str, Any]:
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise _error(path, f"{where} must be a mapping of dotted CLI keys to values, got {type(mapping).__name__}")
    for key in mapping:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*\+?", key):
            raise _error(path, f"{where}: {key!r} is not a dotted CLI key like trainer.max_steps")
        if key in RESERVED and not (key == "trainer.logger" and mapping[key] in (False, None)):
            raise _error(path, f"{where}: {key} is set by compare ({RESERVED[key]})")
    # `trainer.logger: false` (no extra logger) is accepted: compare's own CSVLogger replaces the base's anyway
    return {k: v for k, v in mapping.items() if k != "trainer.logger"}


def _resolve_base(path: Path, base: Any) -> Path:
    if not isinstance(base, str) or not base:
        raise _error(path, f"base must be the path of a fit config, got {base!r}")
    candidates = [Path(base)] if Path(base).is_absolute() else [Path.cwd() / base, path.parent / base, REPO_ROOT / base]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    from fl_lightning.run.bundled_configs import find

    if find(base) is not None:  # a config shipped with the package, by name
        return find(base).resolve()
    raise _error(path, f"base config {base!r} not found (looked at {', '.join(str(c) for c in candidates)})")


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file; every problem is a ValueError naming the setting."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file {path} not found")
    from fl_lightning.run.config_files import load_yaml

    raw = load_yaml(path)  # a syntax error or a duplicate key: one line naming the file and line
    if not isinstance(raw, dict):
        raise _error(path, "must be a YAML mapping with keys " + ", ".join(KEYS))
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise _error(path, f"unknown key(s) {unknown}; allowed: {list(KEYS)}")
    for required in ("base", "runs"):
        if required not in raw:
            raise _error(path, f"missing required key `{required}`")

    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds:
        raise _error(path, f"seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise _error(path, f"seeds must be integers >= 0, got {seeds}")
    if len(set(seeds)) != len(seeds):
        raise _error(path, f"seeds must be distinct, got {seeds}")

    runs = raw["runs"]
    if not isinstance(runs, dict) or not runs:
        raise _error(path, "runs must be a non-empty mapping of run name -> dotted CLI keys")
    runs = expand_grid(path, runs, raw.get("grid"))
    checked_runs: dict[str, dict[str, Any]] = {}
    dirs: dict[str, str] = {}
    for name, keys in runs.items():
        if not isinstance(name, str) or not name.strip():
            raise _error(path, f"run names must be non-empty strings, got {name!r}")
        if dir_name(name) in dirs:
            raise _error(path, f"runs {dirs[dir_name(name)]!r} and {name!r} share the directory name {dir_name(name)!r}")
        dirs[dir_name(name)] = name
        checked_runs[name] = _check_keys(path, f"runs.{name}", keys)

    targets = raw.get("targets") or []
    if not isinstance(targets, list) or any(
        isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and 0 < t <= 1) for t in targets
    ):
        raise _error(path, f"targets must be a list of accuracies in (0, 1], got {targets!r}")
    if len(set(targets)) != len(targets):
        raise _error(path, f"targets must be distinct, got {targets}")

    scatter = raw.get("scatter")
    if scatter is not None and not (isinstance(scatter, list) and len(scatter) == 2 and len(set(scatter)) == 2 and set(scatter) <= set(checked_runs)):
        raise _error(path, f"scatter must name two different runs of {list(checked_runs)}, got {scatter!r}")

    wandb = raw.get("wandb")
    if wandb is not None and not isinstance(wandb, dict):
        raise _error(path, f"wandb must be a mapping of WandbLogger arguments (e.g. {{project: name}}), got {wandb!r}")

    return Sweep(
        path=path,
        base=_resolve_base(path, raw["base"]),
        runs=checked_runs,
        seeds=list(seeds),
        overrides=_check_keys(path, "overrides", raw.get("overrides")),
        targets=sorted(float(t) for t in targets),
        wandb=dict(wandb) if wandb is not None else None,
        scatter=tuple(scatter) if scatter is not None else None,
    )


def _grid_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (dict, list)) else f"{value:g}" if isinstance(value, float) else str(value)


def expand_grid(path: Path, runs: dict[str, Any], grid: Any) -> dict[str, Any]:
    """Every run x every combination of the ``grid`` values, named ``"<run> <key>=<value> ..."``
    (``<key>``: the last part of the dotted key); a run's own setting of a grid key is replaced."""
    if grid is None:
        return runs
    grid = _check_keys(path, "grid", grid)
    if not grid:
        raise _error(path, "grid must map dotted CLI keys to non-empty lists of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _error(path, f"grid.{key} must be a non-empty list of values, got {values!r}")
    expanded: dict[str, Any] = {}
    for name, keys in runs.items():
        for combination in itertools.product(*grid.values()):
            suffix = " ".join(f"{k.rsplit('.', 1)[-1]}={_grid_value(v)}" for k, v in zip(grid, combination))
            if not isinstance(keys, (dict, type(None))):
                expanded[f"{name} {suffix}"] = keys  # rejected with its name by _check_keys
                continue
            expanded[f"{name} {suffix}"] = {**(keys or {}), **dict(zip(grid, combination))}
    return expanded


def cli_value(value: Any) -> str:
    """A YAML value as one CLI argument: strings as they are, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def run_args(sweep: Sweep, name: str, seed: int, out: Path) -> list[str]:
    """The ``fl-lightning fit`` arguments of one run x seed (without the subcommand)."""
    run_dir = sweep.run_dir(out, name, seed)
    args = ["--config", str(sweep.base)]
    for key, value in {**sweep.overrides, **sweep.runs[name]}.items():
        args += [f"--{key}", cli_value(value)]
    loggers: list[dict[str, Any]] = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out / "runs"), "name": dir_name(name), "version": f"seed{seed}"},
        }
    ]
    if sweep.wandb is not None:
        wandb_args = {
            "name": f"{name} seed{seed}",
            "group": name,  # wandb aggregates a group's seeds, like the plots
            "job_type": sweep.path.stem,
            "save_dir": str(run_dir),
            **sweep.wandb,
        }
        loggers.append({"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": wandb_args})
    args += [
        "--seed_everything", str(seed),
        "--data.init_args.seed", str(seed),
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.logger", json.dumps(loggers if len(loggers) > 1 else loggers[0]),
    ]  # fmt: skip
    if sweep.targets:
        target = {"class_path": "fl_lightning.engine.callbacks.TargetAccuracy", "init_args": {"targets": sweep.targets}}
        args += ["--trainer.callbacks+", json.dumps(target)]
    return args

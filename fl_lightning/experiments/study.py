"""The study file of ``fl-lightning tune``: loading, validation, search spaces and each trial's CLI arguments.

```yaml
base: configs/quickstart.yaml        # a fit config, found as compare's base is
overrides: {trainer.enable_checkpointing: false}   # dotted CLI keys of every trial and test run
trials: 20                           # complete or pruned trials per method (the same for every method)
rounds: 30                           # trainer.max_steps of each trial and each test run
evaluate_every: 5                    # rounds between evaluations: the pruner's steps
metric: val/acc                      # what a trial is scored by (its value at the last evaluation)
direction: maximize                  # or minimize (default: minimize for a metric named *loss*)
seed: 0                              # the trials' training seed (seed_everything, data.init_args.seed)
test_seeds: [100, 101, 102]          # the fresh seeds each method's best trial is re-run on, scored on the test set
sampler: {name: tpe, seed: 0}        # tpe | random | grid | qmc, and the sampler's own arguments
pruner: {name: median, n_warmup_steps: 10}   # median | hyperband | successive_halving | none
methods:
  FedAvg:
    set: {model.algorithm: {class_path: fl_lightning.algorithms.FedAvg}}
    space:
      model.local.lr: {float: [0.01, 1.0], log: true}
  FedProx:
    set: {model.algorithm: {class_path: fl_lightning.algorithms.FedProx}}
    space:
      model.local.lr: {float: [0.01, 1.0], log: true}
      model.algorithm.init_args.mu: {float: [0.0001, 1.0], log: true}
      model.local.steps: {int: [1, 20]}
  FedAdam:
    set: {model.algorithm: {class_path: fl_lightning.algorithms.FedAdam}}
    space:
      model.local.lr: {float: [0.01, 1.0], log: true}
      model.algorithm.init_args.global_lr: {float: [0.001, 0.1], log: true}
```
A space entry is ``{float: [low, high]}`` (``log: true``, ``step``), ``{int: [low, high]}`` (``log``, ``step``) or
``{choice: [values]}``; ``when: {key: value}`` samples it only in trials where the earlier entry ``key`` took
``value`` (a conditional key). Every method gets the same budget, trials x rounds x clients per round; a study whose
methods differ (a method's own ``trials``, ``rounds``, or a ``set`` that changes the clients per round) is refused
unless it says ``unequal_budgets: true``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.experiments.sweep import _check_keys, _error, _resolve_base, cli_value, dir_name

KEYS = ("base", "overrides", "trials", "rounds", "evaluate_every", "metric", "direction", "seed", "test_seeds", "sampler",
        "pruner", "methods", "unequal_budgets")  # fmt: skip
METHOD_KEYS = ("set", "space", "trials", "rounds")
SAMPLERS = ("tpe", "random", "grid", "qmc")
PRUNERS = ("median", "hyperband", "successive_halving", "none")
RESERVED = ("trainer.max_steps", "trainer.val_check_interval", "seed_everything", "data.init_args.seed", "trainer.logger",
            "trainer.default_root_dir")  # fmt: skip


@dataclass(frozen=True)
class Parameter:
    """One searched key: ``kind`` float / int / choice, its range or choices, and the condition it is sampled under."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple = ()
    when: tuple[tuple[str, Any], ...] = ()

    def applies(self, chosen: dict[str, Any]) -> bool:
        return all(k in chosen and chosen[k] == v for k, v in self.when)

    def suggest(self, trial: Any) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_categorical(self.key, list(self.choices))


@dataclass
class Method:
    name: str
    set: dict[str, Any]
    space: list[Parameter]
    trials: int
    rounds: int

    def sample(self, trial: Any) -> dict[str, Any]:
        """The trial's values of the space's keys (define-by-run: a conditional key only where its condition holds)."""
        chosen: dict[str, Any] = {}
        for parameter in self.space:
            if parameter.applies({**self.set, **chosen}):
                chosen[parameter.key] = parameter.suggest(trial)
        return chosen


@dataclass
class Study:
    path: Path
    base: Path
    methods: dict[str, Method]
    overrides: dict[str, Any] = field(default_factory=dict)
    evaluate_every: int = 1
    metric: str = "val/acc"
    direction: str = "maximize"
    seed: int = 0
    test_seeds: list[int] = field(default_factory=lambda: [100, 101, 102])
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "median"})
    unequal_budgets: bool = False

    def trial_dir(self, out: Path, method: str, number: int) -> Path:
        return out / "runs" / dir_name(method) / f"trial{number:03d}"

    def test_dir(self, out: Path, method: str, seed: int) -> Path:
        return out / "runs" / dir_name(method) / "test" / f"seed{seed}"

    def args(self, method: str, values: dict[str, Any], seed: int, run_dir: Path) -> list[str]:
        """The ``fl-lightning fit`` arguments of one run of ``method`` with the searched ``values``."""
        m = self.methods[method]
        args = ["--config", str(self.base)]
        for key, value in {**self.overrides, **m.set, **values}.items():
            args += [f"--{key}", cli_value(value)]
        logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                  "init_args": {"save_dir": str(run_dir.parent), "name": "", "version": run_dir.name}}  # fmt: skip
        return args + [
            "--trainer.max_steps", str(m.rounds), "--trainer.val_check_interval", str(self.evaluate_every),
            "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
            "--trainer.default_root_dir", str(run_dir), "--trainer.logger", cli_value(logger),
        ]  # fmt: skip


def _positive_int(path: Path, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(path, f"{where} must be an integer >= 1, got {value!r}")
    return value


def _number(path: Path, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _error(path, f"{where} must be a finite number, got {value!r}")
    return value


def parse_parameter(path: Path, where: str, key: str, spec: Any, earlier: dict[str, Parameter], fixed: dict[str, Any]) -> Parameter:
    """One space entry, checked: its kind, range (low < high, > 0 for a log scale) and condition."""
    if not isinstance(spec, dict):
        raise _error(path, f"{where}: give {{float: [low, high]}}, {{int: [low, high]}} or {{choice: [values]}}, got {spec!r}")
    kinds = [k for k in ("float", "int", "choice") if k in spec]
    unknown = sorted(set(spec) - {"float", "int", "choice", "log", "step", "when"})
    if len(kinds) != 1 or unknown:
        raise _error(path, f"{where}: give exactly one of float, int, choice (with optional log, step, when), got keys {sorted(spec)}")
    kind, when = kinds[0], spec.get("when") or {}
    if not isinstance(when, dict) or any(k not in earlier and k not in fixed for k in when):
        raise _error(path, f"{where}.when must map earlier space keys (or the method's set keys) to values, got {when!r}")
    if kind == "choice":
        choices = spec["choice"]
        if not isinstance(choices, list) or not choices or len({repr(c) for c in choices}) != len(choices):
            raise _error(path, f"{where}.choice must be a non-empty list of distinct values, got {choices!r}")
        if "log" in spec or "step" in spec:
            raise _error(path, f"{where}: log and step apply to float and int ranges, not to choice")
        return Parameter(key, kind, choices=tuple(choices), when=tuple(when.items()))
    bounds = spec[kind]
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise _error(path, f"{where}.{kind} must be [low, high], got {bounds!r}")
    low, high = (_number(path, f"{where}.{kind}", b) for b in bounds)
    if kind == "int" and not all(isinstance(b, int) for b in bounds):
        raise _error(path, f"{where}.int bounds must be integers, got {bounds!r}")
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        raise _error(path, f"{where}.log must be true or false, got {log!r}")
    if not low < high or (log and low <= 0):
        raise _error(path, f"{where}.{kind} must have low < high{' and low > 0 (log scale)' if log else ''}, got {bounds!r}")
    if step is not None and (_number(path, f"{where}.step", step) <= 0 or log):
        raise _error(path, f"{where}.step must be > 0 and cannot be combined with log, got {step!r}")
    return Parameter(key, kind, low, high, log, step, when=tuple(when.items()))


def _keys(path: Path, where: str, mapping: Any) -> dict[str, Any]:
    """Dotted CLI keys, none of them one that tune sets itself."""
    for key in mapping if isinstance(mapping, dict) else ():
        if key in RESERVED:
            raise _error(path, f"{where}: {key} is set by tune (from trials, rounds, evaluate_every, seed and test_seeds)")
    return _check_keys(path, where, mapping)


def _method(path: Path, name: Any, raw: Any, trials: int, rounds: int) -> Method:
    where = f"methods.{name}"
    if not isinstance(name, str) or not name.strip():
        raise _error(path, f"method names must be non-empty strings, got {name!r}")
    if not isinstance(raw, dict) or sorted(set(raw) - set(METHOD_KEYS)):
        raise _error(path, f"{where} must be a mapping with keys among {list(METHOD_KEYS)}, got {raw!r}")
    fixed = _keys(path, f"{where}.set", raw.get("set"))
    space_raw = _keys(path, f"{where}.space", raw.get("space"))
    space: dict[str, Parameter] = {}
    for key, spec in space_raw.items():
        if key in fixed:
            raise _error(path, f"{where}.space: {key} is also in set; search it or fix it, not both")
        space[key] = parse_parameter(path, f"{where}.space.{key}", key, spec, space, fixed)
    own_trials = _positive_int(path, f"{where}.trials", raw["trials"]) if "trials" in raw else trials
    own_rounds = _positive_int(path, f"{where}.rounds", raw["rounds"]) if "rounds" in raw else rounds
    return Method(name, fixed, list(space.values()), own_trials, own_rounds)


def load_study(path: str | Path) -> Study:
    """Read and validate a study file; every problem is a ValueError naming the setting."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"study file {path} not found")
    from fl_lightning.run.config_files import load_yaml

    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise _error(path, "must be a YAML mapping with keys " + ", ".join(KEYS))
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise _error(path, f"unknown key(s) {unknown}; allowed: {list(KEYS)}")
    for required in ("base", "methods", "trials", "rounds"):
        if required not in raw:
            raise _error(path, f"missing required key `{required}`")
    trials, rounds = _positive_int(path, "trials", raw["trials"]), _positive_int(path, "rounds", raw["rounds"])
    evaluate_every = _positive_int(path, "evaluate_every", raw.get("evaluate_every", max(1, rounds // 10)))
    if evaluate_every > rounds:
        raise _error(path, f"evaluate_every must be in 1..rounds ({rounds}), got {evaluate_every}")
    methods_raw = raw["methods"]
    if not isinstance(methods_raw, dict) or not methods_raw:
        raise _error(path, "methods must be a non-empty mapping of method name -> {set, space}")
    methods, dirs = {}, {}
    for name, spec in methods_raw.items():
        methods[name] = _method(path, name, spec, trials, rounds)
        if dir_name(name) in dirs:
            raise _error(path, f"methods {dirs[dir_name(name)]!r} and {name!r} share the folder name {dir_name(name)!r}")
        dirs[dir_name(name)] = name
    metric = raw.get("metric", "val/acc")
    if not isinstance(metric, str) or not metric:
        raise _error(path, f"metric must be a logged metric's name such as val/acc, got {metric!r}")
    direction = raw.get("direction", "minimize" if "loss" in metric else "maximize")
    if direction not in ("maximize", "minimize"):
        raise _error(path, f"direction must be maximize or minimize, got {direction!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _error(path, f"seed must be an integer >= 0, got {seed!r}")
    test_seeds = raw.get("test_seeds", [100, 101, 102])
    if not isinstance(test_seeds, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in test_seeds) \
            or len(set(test_seeds)) != len(test_seeds):  # fmt: skip
        raise _error(path, f"test_seeds must be a list of distinct integers >= 0 (empty: no test runs), got {test_seeds!r}")
    if seed in test_seeds:
        raise _error(path, f"test_seeds must be fresh: seed {seed} is the tuning seed")
    sampler = _named(path, "sampler", raw.get("sampler", {"name": "tpe"}), SAMPLERS)
    pruner = _named(path, "pruner", raw.get("pruner", {"name": "median"}), PRUNERS)
    if sampler["name"] == "grid" and any(p.kind != "choice" or p.when for m in methods.values() for p in m.space):
        raise _error(path, "sampler grid needs every space entry to be an unconditional {choice: [values]}")
    unequal = raw.get("unequal_budgets", False)
    if not isinstance(unequal, bool):
        raise _error(path, f"unequal_budgets must be true or false, got {unequal!r}")
    return Study(path, _resolve_base(path, raw["base"]), methods, _keys(path, "overrides", raw.get("overrides")),
                 evaluate_every, metric, direction, seed, list(test_seeds), sampler, pruner, unequal)  # fmt: skip


def _named(path: Path, where: str, spec: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or spec.get("name") not in allowed:
        raise _error(path, f"{where} must be {{name: one of {', '.join(allowed)}, ...its arguments}}, got {spec!r}")
    return dict(spec)

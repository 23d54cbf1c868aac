"""The documented ranges of the project's settings, checked before Lightning is imported.

``RANGES`` is the one table of them (docs/settings.md lists the same ranges). Each entry names
the class whose ``__init__`` (or the CLI function) refuses the value, which stays the authority:
the entry repeats that refusal's message word for word, so the early line is the line the run
would end with, and ``tests/test_value_errors.py`` builds every owner with every entry's sample bad
value and compares the two messages. The table's keys are the settings as the user writes them,
without ``init_args``:

- ``model.local.lr``, ``data.num_clients``, ``trainer.max_steps``: a setting of a fixed group (``data.*``
  applies to the project's data modules, whatever their class);
- ``model.compression.up[TopK].ratio``, ``model.algorithm[FedProx].mu``: an argument of one class of
  a class setting (``[*]``: of every project class of that setting taking it, e.g. ``global_lr``).

``refusals`` reads the command's effective settings (its config files, ``base:`` chains expanded
and later files overriding earlier ones, then the command line) and answers one line per refused
value. A value of the wrong type (``--model.local.steps 1.5``), a setting of a class given by its
import path outside the project, and every rule across several settings are left to the classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

SUBCOMMANDS = ("fit", "validate", "test", "predict")
MAX_LOCAL_STEPS = 100_000  # fl_lightning.core.config.MAX_LOCAL_STEPS (tests/test_value_errors.py checks they agree)
_NO = object()


@dataclass(frozen=True)
class Range:
    """One setting's allowed values: ``ok(value, siblings)``, and the owner's refusal ``message(value, siblings)``."""

    kind: str  # how the parser reads the value: float, int, number (int or float), str; "?" suffix: null allowed
    ok: Callable[[Any, dict], bool]
    message: Callable[[Any, dict], str]
    owner: str  # the class (or CLI function) that refuses it, the authority: "module:Name"
    bad: Any  # a refused sample value (the test builds the owner with it)


def _finite_positive(v, s):
    return 0 < v < math.inf


def _at_least(n):
    return lambda v, s: v >= n


LOCAL = "fl_lightning.core.config:LocalTraining"
DATA = "datamodules.federated:FederatedDataModule"
PRIVACY = "fl_lightning.pipeline.privacy:ClientPrivacy"
RECORD_PRIVACY = "fl_lightning.pipeline.record_privacy:RecordPrivacy"
TRAINER = "fl_lightning.run.cli_app:_check_trainer"
CLOCK = "fl_lightning.clock:SimClock"
ASYNC = "fl_lightning.clock.asynchronous:AsyncAggregation"
ROBUST = "fl_lightning.robust.aggregation:Robust"
ROBUST_RULES = ("median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median", "centered_clipping", "norm_bound", "fltrust")
# (fl_lightning.robust.aggregation.RULES: tests/test_robust_cli.py checks they agree)
LORA_METHODS = ("factors", "stacked", "exact_residual", "svd", "zero_pad", "share_a")
# (fl_lightning.lora.methods.METHODS: tests/test_lora_aggregation_cli.py checks they agree)

RANGES: dict[str, Range] = {
    # ---- local training (fl_lightning.core.config.LocalTraining) ----
    "model.local.lr": Range("float", _finite_positive, lambda v, s: f"local.lr must be > 0 and finite, got {v}", LOCAL, -1.0),
    "model.local.lr_decay": Range("float", lambda v, s: 0 < v <= 1, lambda v, s: f"local.lr_decay must be in (0, 1], got {v}", LOCAL, 1.5),
    "model.local.steps": Range(
        "int?", lambda v, s: 1 <= v <= MAX_LOCAL_STEPS,
        lambda v, s: f"local.steps must be >= 1, got {v}" if v < 1 else
        f"local.steps must be in [1, {MAX_LOCAL_STEPS}] (local steps per client per round), got {v}",
        LOCAL, 0,
    ),  # fmt: skip
    "model.local.epochs": Range("int?", _at_least(1), lambda v, s: f"local.epochs must be >= 1, got {v}", LOCAL, 0),
    "model.local.batch_size": Range(
        "int?", _at_least(1), lambda v, s: f"local.batch_size must be >= 1 (or null for full batch), got {v}", LOCAL, 0
    ),
    "model.local.weight_decay": Range("float", lambda v, s: 0 <= v < math.inf, lambda v, s: f"local.weight_decay must be >= 0, got {v}", LOCAL, -0.1),
    "model.local.lr_schedule": Range(
        "str", lambda v, s: v in ("exponential", "inv_sqrt", "cosine", "step"),
        lambda v, s: f"local.lr_schedule must be 'exponential', 'inv_sqrt', 'cosine' or 'step', got {v!r}", LOCAL, "linear",
    ),  # fmt: skip
    "model.local.warmup_rounds": Range("int", _at_least(0), lambda v, s: f"local.warmup_rounds must be an integer >= 0, got {v!r}", LOCAL, -1),
    "model.local.personal_lr": Range("float?", lambda v, s: v > 0, lambda v, s: f"local.personal_lr must be > 0 (or null for local.lr), got {v}", LOCAL, 0.0),
    # ---- the trainer (fl_lightning.run.cli_app._check_trainer; max_steps for fit only) ----
    "trainer.max_steps": Range("int", _at_least(1), lambda v, s: f"trainer.max_steps is the number of rounds and must be >= 1, got {v}", TRAINER, 0),
    "trainer.val_check_interval": Range(
        "number?", lambda v, s: v > 0,
        lambda v, s: f"trainer.val_check_interval must be > 0 (rounds between evaluations, or a fraction in (0, 1]), got {v}", TRAINER, -1,
    ),  # fmt: skip
    # ---- the data (datamodules.federated.FederatedDataModule and its subclasses) ----
    "data.num_clients": Range("int", _at_least(1), lambda v, s: f"num_clients must be >= 1, got {v}", DATA, 0),
    "data.holdout_fraction": Range("float", lambda v, s: 0 <= v < 1, lambda v, s: f"holdout_fraction must be in [0, 1), got {v}", DATA, 1.0),
    "data.val_fraction": Range(
        "float", lambda v, s: 0 <= v < 1 - s.get("holdout_fraction", 0.0),
        lambda v, s: f"val_fraction must be in [0, 1 - holdout_fraction) = [0, {1.0 - s.get('holdout_fraction', 0.0):g}), got {v}", DATA, 1.0,
    ),  # fmt: skip
    "data.new_client_fraction": Range("float", lambda v, s: 0 <= v < 1, lambda v, s: f"data.new_client_fraction must be in [0, 1), got {v}", DATA, 1.0),
    "data.eval_batch_size": Range("int", _at_least(1), lambda v, s: f"eval_batch_size must be >= 1, got {v}", DATA, 0),
    "data.seed": Range("int?", _at_least(0), lambda v, s: f"data.seed must be an integer >= 0, got {v}", DATA, -1),
    "data.participation[UniformSampling].clients_per_round": Range(
        "number", lambda v, s: v >= 1 if isinstance(v, int) else 0 < v <= 1,
        lambda v, s: f"clients_per_round must be >= 1, got {v}" if isinstance(v, int) else
        f"clients_per_round as a fraction must be in (0, 1], got {v}",
        "fl_lightning.core.participation:UniformSampling", 1.5,
    ),  # fmt: skip
    # ---- compression (fl_lightning.compression) ----
    **{
        f"model.compression.{link}[{name}].{arg}": entry
        for link in ("up", "down")
        for name in ("TopK", "RandomK")
        for arg, entry in {
            "ratio": Range("float?", lambda v, s, n=name: 0 < v <= 1, lambda v, s, n=name: f"{n}.ratio must be in (0, 1], got {v}",
                           f"fl_lightning.compression:{name}", 1.5),
            "k": Range("int?", _at_least(1), lambda v, s, n=name: f"{n}.k must be an integer >= 1, got {v}", f"fl_lightning.compression:{name}", 0),
        }.items()  # fmt: skip
    },
    **{
        f"model.compression.{link}[QSGD].levels": Range(
            "int", _at_least(1), lambda v, s: f"QSGD.levels (s) must be an integer >= 1, got {v}", "fl_lightning.compression:QSGD", 0
        )
        for link in ("up", "down")
    },
    # ---- client-level privacy (fl_lightning.pipeline.privacy.ClientPrivacy) and record-level (RecordPrivacy) ----
    **{
        f"model.{setting}.{arg}": entry
        for setting, owner in (("privacy", PRIVACY), ("record_privacy", RECORD_PRIVACY))
        for arg, entry in {
            "clip_norm": Range("float", _finite_positive, lambda v, s, p=setting: f"{p}.clip_norm must be > 0 (finite), got {v}", owner, 0.0),
            "noise_multiplier": Range("float", lambda v, s: 0 <= v < math.inf,
                                      lambda v, s, p=setting: f"{p}.noise_multiplier must be >= 0 (finite), got {v}", owner, -1.0),
            "delta": Range("float", lambda v, s: 0 < v < 1, lambda v, s, p=setting: f"{p}.delta must be in (0, 1), got {v}", owner, 2.0),
        }.items()  # fmt: skip
    },
    "model.privacy.target_epsilon": Range(
        "float?", _finite_positive, lambda v, s: f"privacy.target_epsilon must be > 0 (or null), got {v}", PRIVACY, 0.0
    ),
    "model.privacy.target_quantile": Range("float", lambda v, s: 0 < v < 1, lambda v, s: f"privacy.target_quantile must be in (0, 1), got {v}", PRIVACY, 1.0),
    "model.privacy.clip_lr": Range("float", lambda v, s: v > 0, lambda v, s: f"privacy.clip_lr must be > 0, got {v}", PRIVACY, 0.0),
    "model.privacy.count_noise": Range("float?", lambda v, s: v > 0, lambda v, s: f"privacy.count_noise must be > 0 (or null), got {v}", PRIVACY, 0.0),
    # ---- simulated time (fl_lightning.clock.SimClock) and asynchronous aggregation (AsyncAggregation) ----
    **{
        f"model.clock.{arg}": Range("float", _finite_positive, lambda v, s, a=arg: f"clock.{a} must be > 0 and finite, got {v!r}", CLOCK, -1.0)
        for arg in ("step_cost", "bandwidth", "period")
    },
    **{
        f"model.clock.{arg}": Range("float", lambda v, s: 0 <= v < math.inf, lambda v, s, a=arg: f"clock.{a} must be >= 0 and finite, got {v!r}", CLOCK, -1.0)
        for arg in ("speed_sigma", "bandwidth_sigma")
    },
    "model.clock.duty": Range("float", lambda v, s: 0 < v <= 1, lambda v, s: f"clock.duty must be in (0, 1], got {v!r}", CLOCK, 1.5),
    "model.clock.deadline": Range(
        "float?", _finite_positive, lambda v, s: f"clock.deadline must be > 0 seconds (or null: wait for the slowest client), got {v!r}", CLOCK, 0.0
    ),
    **{
        f"model.asynchronous.{arg}": Range("int", _at_least(1), lambda v, s, a=arg: f"asynchronous.{a} must be an integer >= 1, got {v!r}", ASYNC, 0)
        for arg in ("concurrency", "buffer_size")
    },
    "model.asynchronous.alpha": Range("float", lambda v, s: 0 < v <= 1, lambda v, s: f"asynchronous.alpha must be in (0, 1], got {v!r}", ASYNC, 1.5),
    # ---- LoRA aggregation (fl_lightning.lora.methods.resolve) ----
    "model.lora_aggregation": Range(
        "str?", lambda v, s: v in LORA_METHODS,
        lambda v, s: f"model.lora_aggregation must be one of {', '.join(LORA_METHODS)}, got {v!r}", "fl_lightning.lora.methods:resolve", "svdd",
    ),  # fmt: skip
    # ---- robust aggregation (fl_lightning.robust.Robust) ----
    "model.robust.rule": Range(
        "str", lambda v, s: v in ROBUST_RULES,
        lambda v, s: f"robust.rule must be one of {', '.join(ROBUST_RULES)}, got {v!r}", ROBUST, "krumm",
    ),  # fmt: skip
    "model.robust.f": Range("int?", _at_least(0), lambda v, s: f"robust.f must be an integer >= 0, got {v}", ROBUST, -1),
    "model.robust.fraction": Range("float?", lambda v, s: 0 <= v < 1, lambda v, s: f"robust.fraction must be in [0, 1), got {v}", ROBUST, 1.0),
    "model.robust.beta": Range(
        "float?", lambda v, s: 0 <= v < 0.5, lambda v, s: f"robust.beta must be in [0, 0.5) (2 beta < 1), got {v}", ROBUST, 0.5
    ),
    "model.robust.m": Range("int?", _at_least(1), lambda v, s: f"robust.m must be an integer >= 1 (or null for n - f), got {v}", ROBUST, 0),
    "model.robust.root_size": Range("int", _at_least(1), lambda v, s: f"robust.root_size must be an integer >= 1, got {v}", ROBUST, 0),
    "model.robust.iters": Range("int?", _at_least(1), lambda v, s: f"robust.iters must be an integer >= 1, got {v}", ROBUST, 0),
    **{
        f"model.robust.{name}": Range("float", _finite_positive, lambda v, s, n=name: f"robust.{n} must be > 0, got {v}", ROBUST, 0.0)
        for name in ("nu", "tau", "max_norm")
    },
    # ---- attacks (fl_lightning.adversary.Attack) ----
    "model.attack.fraction": Range(
        "float", lambda v, s: 0 <= v < 1, lambda v, s: f"attack.fraction must be in [0, 1), got {v}", "fl_lightning.adversary:Attack", 1.0
    ),
    # ---- algorithms (fl_lightning.algorithms; global_lr: fl_lightning.algorithms.base.Algorithm) ----
    "model.algorithm[*].global_lr": Range("float", lambda v, s: v > 0, lambda v, s: f"algorithm global_lr must be > 0, got {v}",
                                          "fl_lightning.algorithms:FedAvg", 0.0),  # fmt: skip
    "model.algorithm[FedProx].mu": Range("float", _at_least(0), lambda v, s: f"FedProx mu must be >= 0, got {v}", "fl_lightning.algorithms:FedProx", -0.1),
    "model.algorithm[QFFL].q": Range("number", lambda v, s: 0 <= v < math.inf, lambda v, s: f"QFFL q must be a number >= 0, got {v!r}",
                                     "fl_lightning.algorithms:QFFL", -1),
    "model.algorithm[AFL].lambda_lr": Range("number", lambda v, s: 0 <= v < math.inf, lambda v, s: f"AFL lambda_lr must be a number >= 0, got {v!r}",
                                            "fl_lightning.algorithms:AFL", -0.1),
    "model.algorithm[PropFair].baseline": Range(
        "number", _finite_positive, lambda v, s: f"PropFair baseline must be a number > 0, got {v!r}", "fl_lightning.algorithms:PropFair", 0.0
    ),
    "model.algorithm[FedDyn].alpha": Range("float", lambda v, s: v > 0, lambda v, s: f"FedDyn alpha must be > 0, got {v}", "fl_lightning.algorithms:FedDyn", 0.0),
    "model.algorithm[FedSAM].rho": Range("float", _at_least(0), lambda v, s: f"FedSAM rho must be >= 0, got {v}", "fl_lightning.algorithms:FedSAM", -0.1),
    "model.algorithm[FedCM].a": Range("float", lambda v, s: 0 < v <= 1, lambda v, s: f"FedCM a must be in (0, 1], got {v}", "fl_lightning.algorithms:FedCM", 1.5),
    "model.algorithm[FedAvgM].momentum": Range(
        "float", lambda v, s: 0 <= v < 1, lambda v, s: f"FedAvgM momentum must be in [0, 1), got {v}", "fl_lightning.algorithms:FedAvgM", 1.0
    ),
    "model.algorithm[FedAdam].tau": Range("float", lambda v, s: v > 0, lambda v, s: f"FedAdam tau must be > 0, got {v}", "fl_lightning.algorithms:FedAdam", 0.0),
    "model.algorithm[FedExP].eps": Range("float", lambda v, s: v > 0, lambda v, s: f"FedExP eps must be > 0, got {v}", "fl_lightning.algorithms:FedExP", 0.0),
    "model.algorithm[FedFV].alpha": Range("number", lambda v, s: 0 <= v <= 1, lambda v, s: f"FedFV alpha must be a number in [0, 1], got {v!r}",
                                          "fl_lightning.algorithms:FedFV", 1.5),
    "model.algorithm[FedFV].tau": Range("int", _at_least(0), lambda v, s: f"FedFV tau must be an int >= 0, got {v!r}", "fl_lightning.algorithms:FedFV", -1),
    "model.algorithm[FedMGDAPlus].epsilon": Range(
        "number", lambda v, s: 0 <= v <= 1, lambda v, s: f"FedMGDAPlus epsilon must be a number in [0, 1], got {v!r}",
        "fl_lightning.algorithms:FedMGDAPlus", -0.1,
    ),
}

# The classes a class setting below a class setting accepts by short name (the parser's list,
# fl_lightning.run.config_errors.allowed_classes; tests/test_value_errors.py checks they agree).
NESTED_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "model.compression.up": ("Compressor", ("Cast", "Compressor", "Identity", "Int8", "QSGD", "RandomK", "ScaledSign", "TopK")),
    "model.compression.down": ("Compressor", ("Cast", "Compressor", "Identity", "Int8", "QSGD", "RandomK", "ScaledSign", "TopK")),
    "data.participation": ("Participation", ("BernoulliParticipation", "CyclicParticipation", "UniformSampling")),
    "data.partition": ("Partitioner", ("Contiguous", "Dirichlet", "FlwrPartition", "IID", "NaturalPartition", "QuantitySkew", "Shards")),
}
# The class settings whose value names a class (a string there is a class name, not a value).
CLASS_SETTINGS = {
    "data", "model.algorithm", "model.compression", "model.privacy", "model.record_privacy", "model.attack", "model.model", "model.store",
    "model.execution", "lr_scheduler", "trainer.logger", "trainer.callbacks", "trainer.strategy", "trainer.plugins", *NESTED_CLASSES,
}  # fmt: skip
PROJECT_DATA = ("FederatedDataModule", "VisionDataModule", "TextDataModule", "InstructionDataModule")
PROJECT_ALGORITHMS = (
    "AFL", "APFL", "Ditto", "FAdamET", "FAdamGT", "FedALA", "FedAdam", "FedAlt", "FedAvg", "FedAvgM", "FedAvgP", "FedAvgSVRG", "FedCM",
    "FedBABU", "FedDecorr", "FedDyn", "FedExP", "FedFV", "FedLADA", "FedLC", "FedMGDAPlus", "FedMIM", "FedNTD", "FedNova", "FedProto",
    "FedProx", "FedRS",
    "FedRoD", "FedSAM",
    "FedSim", "FedYogi", "LocalAdam", "MOON", "PFedMe", "PerFedAvg", "PropFair", "QFFL", "SCAFFOLD", "ScaffoldP", "TERM",
)  # fmt: skip
NO_GLOBAL_LR = ("FedAlt", "FedAvgP", "FedProto", "FedSim", "ScaffoldP")  # the algorithms without a global_lr argument


def refusal(key: str, value: Any, siblings: dict | None = None) -> str | None:
    """The owner's message refusing ``value`` for the setting ``key`` of ``RANGES``, or None (allowed,
    or not a value the table judges: a wrong type is the parser's to report)."""
    entry = RANGES[key]
    value = _read(value, entry.kind)
    if value is _NO or value is None:
        return None
    siblings = siblings or {}
    return None if entry.ok(value, siblings) else entry.message(value, siblings)


def _read(value: Any, kind: str) -> Any:
    """``value`` as the parser reads it for a setting of ``kind``, or _NO (not of that type)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
        return None if kind.endswith("?") else _NO
    kind = kind.rstrip("?")
    if isinstance(value, str) and kind != "str":
        value = _number(value)
    if isinstance(value, bool):
        return _NO
    if kind == "str":
        return value if isinstance(value, str) else _NO
    if kind == "int":
        return value if isinstance(value, int) else _NO
    if kind == "float":
        return float(value) if isinstance(value, (int, float)) else _NO
    return value if isinstance(value, (int, float)) else _NO  # number: an int stays an int


def _number(text: str) -> Any:
    for read in (int, float):
        try:
            return read(text.strip())
        except ValueError:
            pass
    return text


# ---- the command's effective settings ------------------------------------------------------------------
def effective_settings(args: list[str]) -> tuple[dict[str, Any], dict[str, str | None], dict[str, str]]:
    """``(values, classes, flags)`` of a command (bases expanded): every setting's last value by its key
    without ``init_args``, the class name of every class setting, and the flag each key was given with."""
    from fl_lightning.run.setting_args import _flags, config_files

    values: dict[str, Any] = {}
    classes: dict[str, str | None] = {}
    flags: dict[str, str] = {}
    subcommand = args[0] if args and args[0] in SUBCOMMANDS else "fit"
    for path in config_files(args):
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict):
            for section in ({k: v for k, v in data.items() if k not in SUBCOMMANDS}, data.get(subcommand)):
                if isinstance(section, dict):
                    _merge(section, "", values, classes)
    for flag, value in _flags(args[1:]):
        if flag.endswith(".help") or value is None:
            continue
        parts = [p for p in flag.split(".") if p != "init_args"]
        if parts and parts[-1] == "class_path":
            _set_class(".".join(parts[:-1]), value, values, classes)
            continue
        key = ".".join(parts)
        flags[key] = flag
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, dict):  # --model.local '{lr: 0.1}', --model.algorithm '{class_path: FedProx}'
            parent, _, name = key.rpartition(".")
            _merge({name: parsed}, f"{parent}." if parent else "", values, classes)
        elif key in CLASS_SETTINGS and isinstance(parsed, str):
            _set_class(key, parsed, values, classes)
        else:
            values[key] = value
    return values, classes, flags


def _merge(node: dict, prefix: str, values: dict, classes: dict) -> None:
    for name, value in node.items():
        if name == "init_args" and isinstance(value, dict):
            _merge(value, prefix, values, classes)
            continue
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if "class_path" in value:
                _set_class(key, value["class_path"], values, classes)
            _merge({k: v for k, v in value.items() if k != "class_path"}, f"{key}.", values, classes)
        elif key in CLASS_SETTINGS and (isinstance(value, str) or value is None):
            _set_class(key, value, values, classes)
        else:
            values[key] = value


def _set_class(key: str, value: Any, values: dict, classes: dict) -> None:
    """A new class at ``key``: the previous class's arguments go (a new class_path starts its own init_args)."""
    name = None if value is None or str(value).lower() in ("null", "none") else str(value)
    if classes.get(key, _NO) != name:
        for k in [k for k in values if k.startswith(f"{key}.")]:
            del values[k]
        for k in [k for k in classes if k.startswith(f"{key}.")]:
            del classes[k]
    classes[key] = name


def _short(name: str | None) -> str | None:
    """A project class's short name (``fl_lightning.compression.TopK`` -> ``TopK``); None for another package's."""
    if name is None:
        return None
    if "." not in name:
        return name
    if name.startswith(("fl_lightning.", "datamodules.", "models.")):
        return name.rsplit(".", 1)[1]
    return None


# ---- the check --------------------------------------------------------------------------------------
def refusals(args: list[str], class_names: bool = True) -> list[str]:
    """One line per setting of the command (``args``: subcommand first, bases expanded) out of its range,
    and (``class_names``; not with user modules, whose classes may be named) per unknown class name of a
    class setting inside a class setting (``NESTED_CLASSES``)."""
    from fl_lightning.run.setting_args import source, unknown_class_line

    values, classes, flags = effective_settings(args)
    subcommand = args[0] if args else "fit"
    lines = []
    for key, (kind, names) in NESTED_CLASSES.items() if class_names else ():
        name = classes.get(key)
        if name and "." not in name and name not in names and name.lower() not in ("null", "none"):
            where = "" if key in flags or any(a == name for a in args) else _in(source(key, name, args) or source(_with_init_args(key), name, args))
            lines.append(unknown_class_line(flags.get(key, key), name, list(names), kind, where))
    for key, value in values.items():
        entry = _entry(key, classes, subcommand)
        if entry is None:
            continue
        group = key.rpartition(".")[0]
        siblings = {k.rpartition(".")[2]: _read(v, "float") for k, v in values.items() if k.rpartition(".")[0] == group}
        if entry == "data.val_fraction" and not _holdout_ok(siblings):
            continue  # the holdout's own line says it
        siblings = {k: v for k, v in siblings.items() if v is not _NO and v is not None}
        line = refusal(entry, value, siblings)
        if line is not None:
            lines.append(line)
    return lines


def _in(path: Path | None) -> str:
    return f" (in {path})" if path else ""


def _with_init_args(key: str) -> str:
    parent, _, last = key.rpartition(".")
    return f"{parent}.init_args.{last}"


def _holdout_ok(siblings: dict) -> bool:
    holdout = siblings.get("holdout_fraction", 0.0)
    return holdout is None or holdout is _NO or 0 <= holdout < 1


def _entry(key: str, classes: dict, subcommand: str) -> str | None:
    """The ``RANGES`` key judging the setting ``key``, or None."""
    if key == "trainer.max_steps" and subcommand != "fit":
        return None  # validate/test/predict ignore it
    if key.startswith("data.") and key.count(".") == 1:
        data = classes.get("data")
        return key if key in RANGES and (data is None or _short(data) in PROJECT_DATA) else None
    setting, _, arg = key.rpartition(".")
    if key in RANGES:  # a fixed group, or the arguments of a setting with one project class (model.privacy)
        return key if classes.get(setting) is None or _short(classes[setting]) is not None else None
    given = classes.get(setting)
    name = "FedAvg" if given is None and setting == "model.algorithm" else _short(given)  # FederatedModule's default
    if name is None:
        return None
    if setting == "model.algorithm" and name in PROJECT_ALGORITHMS and name not in NO_GLOBAL_LR and f"{setting}[*].{arg}" in RANGES:
        return f"{setting}[*].{arg}"
    candidate = f"{setting}[{name}].{arg}"
    return candidate if candidate in RANGES else None

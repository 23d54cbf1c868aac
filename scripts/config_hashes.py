"""Fingerprints of a short run of every shipped config, to check that a refactor is bitwise identical.

    python scripts/config_hashes.py --write [--jobs 2] [--only GLOB]   # baseline: scripts/config_hashes.json
    python scripts/config_hashes.py --check [--jobs 2] [--only GLOB]   # one line per run; exit 1 on a difference
    python scripts/config_hashes.py --list                             # the runs and their fit arguments

Every ``configs/*.yaml`` becomes one or more *runs*, each an ``fl-lightning fit`` subprocess of the
code of the repository this script lies in (``sys.executable``, ``PYTHONPATH`` = that repository,
checked before anything runs), in a fresh temporary folder (its working directory, default_root_dir,
logger save_dir and caches), never in the repository:

- a fit config: one run;
- a sweep (``runs:``, what ``fl-lightning compare`` runs): its runs expanded to fit commands the way
  compare expands them (base config, ``overrides``, the run's keys, ``grid``, seed, CSVLogger, target
  callback), first seed only; every run for sweeps over bundled data, the first ``HUB_SWEEP_RUNS`` for
  sweeps over stand-ins of hub data (ResNet-18 / GPT-2 runs are the slow ones);
- the Monte Carlo spec (``cases:``): every series once, with seed ``base_seed`` (its first run).

Each run is shortened to ``ROUNDS`` rounds with validation at the last one (``SHORTEN``), on the CPU,
on one torch thread (results are bitwise reproducible per thread count), and writes its own
``last.ckpt`` after the last round (an extra ``ModelCheckpoint``). Hub datasets are replaced by the
project's offline fixtures (``fl-lightning fixture``, ``lora-fixture``, ``lora-fixture --instruction``,
written once into ``$CONFIG_HASHES_FIXTURES``, default /tmp/config_hashes_fixtures), with the smaller client settings of the configs' own CPU smoke
commands and the tests (``FIXTURE_SETTINGS``); every override is recorded per run in the table.

The fingerprint of a run: the SHA-256 of every value of that checkpoint (state_dict, optimizer and
scheduler states, callbacks, loops and the ``federated`` dict with the server and client states),
walked as nested dicts/lists: tensors by dtype, shape and raw bytes, other values by ``repr``, with
the run's temporary folder and the fixture folder replaced by placeholders; grouped by their first
``DEPTH`` keys; and of every column of every CSV the run writes (``metrics.csv``: the values as
written). ``--write`` runs everything twice: a key or column that differs between the two runs is
listed in ``unstable`` and excluded (``excluded``, the union over all runs; wall-clock columns such
as ``time/round_s`` are found this way); anything in ``unstable`` that is not a wall-clock timing is
a determinism bug. ``--check`` runs once and compares with the table.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TABLE = Path(__file__).resolve().with_suffix(".json")
ROUNDS = 3
DEPTH = 3  # checkpoint values are hashed in groups of their first DEPTH keys (the table's unit of a difference)
HUB_SWEEP_RUNS = 2  # runs of each sweep over fixture data (vision, text, instruction); every run otherwise
RUN_TIMEOUT_S = 900
VISION = ("cifar10", "cifar100", "tiny_imagenet", "mnist")
ENV = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
}  # fmt: skip


# ---- the runs -----------------------------------------------------------------------------------------
@dataclass
class Run:
    name: str  # "<config stem>" or "<config stem>/<run name>"
    config: str  # config stem
    args: list[str]  # fit arguments with placeholders <REPO>, <FIXTURES>, <RUN>
    notes: list[str] = field(default_factory=list)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _find(name: str, beside: Path) -> Path:
    name = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    for candidate in (beside / name, REPO / name, CONFIGS / name, CONFIGS / Path(name).name):
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"base {name} of a config in {beside} not found")


def chain(path: Path) -> list[dict]:
    """A fit config and its ``base:`` configs, the base first."""
    raw = _load(path)
    return ([] if raw.get("base") is None else chain(_find(raw["base"], path.parent))) + [raw]


def setting(configs: list[dict], dotted: str, overrides: dict | None = None) -> Any:
    """The last value of a dotted key in a config chain (then in dotted ``overrides``), or None."""
    value = None
    for config in configs:
        node: Any = config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        value = node if node is not None else value
    for key, v in (overrides or {}).items():
        if dotted == key or dotted.startswith(key + "."):  # the key itself, or a mapping that holds it
            for part in dotted[len(key) + 1 :].split(".") if dotted != key else []:
                v = v.get(part) if isinstance(v, dict) else None
            value = v if v is not None else value
    return value


def cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def data_kind(configs: list[dict], overrides: dict | None = None) -> str:
    dataset = setting(configs, "data.init_args.dataset", overrides)
    data_class = str(setting(configs, "data.class_path", overrides) or "")
    if dataset in VISION:
        return "vision:" + dataset
    if data_class.endswith("TextDataModule"):
        return "text:" + str(setting(configs, "data.init_args.task", overrides))
    if data_class.endswith("InstructionDataModule"):
        path = str(setting(configs, "data.init_args.dataset_path", overrides))
        return "instruction:" + ("alpaca" if "alpaca" in path else "dolly")
    return "bundled"


def fixture_settings(kind: str, configs: list[dict], overrides: dict | None = None) -> tuple[list[str], list[str]]:
    """The overrides that run a config on the offline fixture of ``kind``, and why."""
    if kind == "bundled":
        return [], []
    family, name = kind.split(":")
    if family == "vision":
        args = ["--data.init_args.dataset_args", json.dumps({**fixture("vision:" + name), "cache_dir": "<RUN>/hf_cache"}),
                "--data.init_args.num_clients", "4", "--data.init_args.participation.init_args.clients_per_round", "2",
                "--model.local.batch_size", "10", "--data.init_args.val_fraction", "0"]  # fmt: skip
        if str(setting(configs, "data.init_args.partition.class_path", overrides) or "").endswith("Dirichlet"):
            args += ["--data.init_args.partition.init_args.min_size", "2"]
        if setting(configs, "model.local.epochs", overrides) is not None:
            args += ["--model.local.epochs", "1"]
        return args, [
            (f"{name}: the `fl-lightning fixture` stand-in (200 train / 100 test images; tiny_imagenet 100 / 50) with the "
             "config's CPU smoke settings (4 clients, 2 per round, Dirichlet min_size 2, 1 local epoch) and batch 10"),
            ("val_fraction 0: at cf0a44a a VisionDataModule's validation split reaches the model as uint8 "
             "(RuntimeError: expected scalar type Byte but found Float); validation runs on the test set instead"),
        ]
    if family == "text":
        args = [*fixture(kind), "--data.init_args.cache_dir", "<RUN>/hf_cache", "--data.init_args.num_clients", "4",
                "--data.init_args.participation.init_args.clients_per_round", "2"]  # fmt: skip
        if str(setting(configs, "data.init_args.partition.class_path", overrides) or "").endswith("Dirichlet"):
            args += ["--data.init_args.partition.init_args.alpha", "1.0"]
        note = f"{name}: the `fl-lightning lora-fixture` GPT-2 and data" + (" (qnli's rows as question1/question2)" if name == "qqp" else "")
        return args, [note + ", 4 clients, 2 per round, Dirichlet alpha 1 (as tests/test_lora_cli.py)"]
    args = [*fixture(kind), "--data.init_args.cache_dir", "<RUN>/hf_cache"]
    note = "the `fl-lightning lora-fixture --instruction` GPT-2 and Dolly data with its printed settings (10 clients)"
    return args, [note + (" (Dolly's rows as Alpaca's columns)" if name == "alpaca" else "")]


def shorten(configs: list[dict], overrides: dict | None = None) -> list[str]:
    """ROUNDS rounds, validation at the last one, CPU, one thread, a last.ckpt of our own; paths in <RUN>."""
    args = ["--threads", "1", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(ROUNDS),
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", "<RUN>/root"]  # fmt: skip
    if isinstance(setting(configs, "trainer.val_check_interval", overrides), int):
        args += ["--trainer.val_check_interval", str(ROUNDS)]
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": "<RUN>/fingerprint", "save_last": True, "save_top_k": 0, "every_n_train_steps": ROUNDS}}  # fmt: skip
    return args + ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+", json.dumps(checkpoint)]


def fit_run(path: Path) -> Run:
    configs = chain(path)
    kind = data_kind(configs)
    extra, notes = fixture_settings(kind, configs)
    args = ["--config", f"<REPO>/configs/{path.name}", *extra]
    if isinstance(setting(configs, "trainer.logger"), dict):
        args += ["--trainer.logger.init_args.save_dir", "<RUN>/logs"]
    return Run(path.stem, path.stem, args + shorten(configs), notes)


def _dir_name(name: str) -> str:  # fl_lightning.experiments.sweep.dir_name
    name = re.sub(r"[^\w.=+-]+", "_", name).strip("_")
    return name if name.strip(".") else "run"


def _grid_value(value: Any) -> str:  # fl_lightning.experiments.sweep._grid_value
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (dict, list)) else f"{value:g}" if isinstance(value, float) else str(value)


def sweep_runs(path: Path) -> list[Run]:
    """A sweep's runs as compare runs them (fl_lightning/experiments/sweep.py: run_args), first seed only."""
    raw = _load(path)
    base = _find(raw["base"], path.parent)
    base_chain = chain(base)
    seed = (raw.get("seeds") or [0])[0]
    overrides = {k: v for k, v in (raw.get("overrides") or {}).items() if k != "trainer.logger"}
    runs: dict[str, dict] = {}
    grid = {k: v for k, v in (raw.get("grid") or {}).items() if k != "trainer.logger"}
    for name, keys in raw["runs"].items():
        keys = {k: v for k, v in (keys or {}).items() if k != "trainer.logger"}
        if not grid:
            runs[name] = keys
            continue
        for combination in itertools.product(*grid.values()):
            suffix = " ".join(f"{k.rsplit('.', 1)[-1]}={_grid_value(v)}" for k, v in zip(grid, combination))
            runs[f"{name} {suffix}"] = {**keys, **dict(zip(grid, combination))}
    kind = data_kind(base_chain, overrides)
    limit = len(runs) if kind == "bundled" else HUB_SWEEP_RUNS
    out = []
    for name, keys in list(runs.items())[:limit]:
        merged = {**overrides, **keys}
        args = ["--config", f"<REPO>/configs/{base.name}"]
        for key, value in merged.items():
            args += [f"--{key}", cli_value(value)]
        logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                  "init_args": {"save_dir": "<RUN>/logs", "name": _dir_name(name), "version": f"seed{seed}"}}  # fmt: skip
        args += ["--seed_everything", str(seed), "--data.init_args.seed", str(seed), "--trainer.logger", json.dumps(logger)]
        if raw.get("targets"):
            target = {"class_path": "fl_lightning.engine.callbacks.TargetAccuracy", "init_args": {"targets": sorted(float(t) for t in raw["targets"])}}
            args += ["--trainer.callbacks+", json.dumps(target)]
        extra, notes = fixture_settings(data_kind(base_chain, merged), base_chain, merged)
        args += extra + shorten(base_chain, merged)
        notes = [f"seed {seed} of {raw.get('seeds') or [0]}"] + notes
        if limit < len(runs):
            notes.append(f"the first {limit} of the sweep's {len(runs)} runs")
        out.append(Run(f"{path.stem}/{name}", path.stem, args, notes))
    return out


def montecarlo_runs(path: Path) -> list[Run]:
    """A Monte Carlo spec's series (fl_lightning/experiments/montecarlo.py), run ``base_seed`` only, logged."""
    raw = _load(path)
    seed = raw.get("base_seed", 0)
    out = []
    for case, series in raw["cases"].items():
        for label, spec in series.items():
            spec = {"config": spec} if isinstance(spec, str) else spec
            config = _find(spec["config"], path.parent)
            configs = chain(config)
            args = ["--config", f"<REPO>/configs/{config.name}"]
            for key, value in (spec.get("overrides") or {}).items():
                args += [f"--{key}", json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)]
            args += ["--seed_everything", str(seed), "--data.init_args.seed", str(seed), "--trainer.logger.init_args.save_dir", "<RUN>/logs"]
            args += shorten(configs, spec.get("overrides"))
            out.append(Run(f"{path.stem}/{case}/{label}", path.stem, args, [f"run 0 (seed {seed}) of {raw.get('runs')}, with its CSVLogger"]))
    return out


def all_runs() -> list[Run]:
    runs = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        raw = _load(path)
        if "cases" in raw:
            runs += montecarlo_runs(path)
        elif "runs" in raw:
            runs += sweep_runs(path)
        else:
            runs.append(fit_run(path))
    return runs


# ---- offline fixtures ----------------------------------------------------------------------------------
FIXTURES = Path(os.environ.get("CONFIG_HASHES_FIXTURES", "/tmp/config_hashes_fixtures"))
_FIXTURE_ARGS: dict[str, Any] = {}


def _cli(args: list[str], cwd: Path) -> str:
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO), "HF_HOME": str(FIXTURES / "hf_home")}
    proc = subprocess.run([sys.executable, "-m", "fl_lightning.commands.cli", *args], cwd=cwd, env=env, check=False,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"fl-lightning {' '.join(args)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout


def make_fixtures() -> None:
    """Write the fixtures once into FIXTURES (``settings.json`` marks a finished one); keep their settings."""
    done = FIXTURES / "settings.json"
    if done.is_file():
        _FIXTURE_ARGS.update(json.loads(done.read_text()))
        return
    import pandas as pd

    cwd = FIXTURES / "_cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    for name in VISION:
        size = ["--train", "100", "--test", "50"] if name == "tiny_imagenet" else ["--train", "200", "--test", "100"]
        printed = json.loads(_cli(["fixture", name, "--out", str(FIXTURES / "vision"), *size], cwd).strip().splitlines()[-1])
        found["vision:" + name] = {"data_files": printed["data_files"]}
    for line in _cli(["lora-fixture", str(FIXTURES / "text")], cwd).splitlines():
        words = shlex.split(line)
        task = words[words.index("--config") + 1].removeprefix("fedit_gpt2_")
        found["text:" + task] = words[words.index("--config") + 2:]
    qnli = json.loads(found["text:qnli"][found["text:qnli"].index("--data.init_args.data_files") + 1])
    qqp = {}
    for split, file in qnli.items():  # QQP's columns, from the qnli fixture's rows
        qqp[split] = str(FIXTURES / "text" / f"qqp_{split}.parquet")
        pd.read_parquet(file).rename(columns={"question": "question1", "sentence": "question2"}).to_parquet(qqp[split])
    found["text:qqp"] = [json.dumps(qqp) if a == json.dumps(qnli) else a for a in found["text:qnli"]]
    words = shlex.split(_cli(["lora-fixture", str(FIXTURES / "instruct"), "--instruction"], cwd).strip().splitlines()[-1])
    dolly = words[words.index("--config") + 2:]
    found["instruction:dolly"] = dolly
    rows = [json.loads(line) for line in Path(dolly[dolly.index("--data.init_args.dataset_path") + 1]).read_text().splitlines()]
    alpaca = FIXTURES / "instruct" / "alpaca.json"  # Alpaca's columns, from the Dolly fixture's rows
    alpaca.write_text(json.dumps([{"instruction": r["instruction"], "input": r["context"], "output": r["response"]} for r in rows]))
    found["instruction:alpaca"] = [str(alpaca) if a.endswith("dolly.jsonl") else a for a in dolly]
    for key, value in found.items():  # the cache folders given by the fixture commands: ours are per run
        if isinstance(value, list) and "--data.init_args.cache_dir" in value:
            i = value.index("--data.init_args.cache_dir")
            found[key] = value[:i] + value[i + 2:]
    found = json.loads(json.dumps(found).replace(str(FIXTURES), "<FIXTURES>"))
    done.write_text(json.dumps(found, indent=1))
    _FIXTURE_ARGS.update(found)


def fixture(kind: str) -> Any:
    if kind not in _FIXTURE_ARGS:
        raise KeyError(f"no offline fixture for {kind}")
    return _FIXTURE_ARGS[kind]


def fixtures_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in FIXTURES.rglob("*") if p.is_file() and "hf_home" not in p.parts and "_cwd" not in p.parts):
        digest.update(str(path.relative_to(FIXTURES)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


# ---- running and fingerprinting ---------------------------------------------------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _leaves(obj: Any, path: tuple, normalize) -> Any:
    import numpy as np
    import torch

    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, normalize(str(key))), normalize)
    elif isinstance(obj, (list, tuple)):
        yield path + ("#len",), repr(len(obj)).encode()
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, str(i)), normalize)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        head = f"{t.dtype} {tuple(t.shape)} {t.layout}".encode()
        if t.is_sparse or t.is_quantized:
            t = t.to_dense() if t.is_sparse else t.int_repr()
        yield path, head + b"\0" + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(obj, np.ndarray):
        yield path, f"ndarray {obj.dtype} {obj.shape}".encode() + b"\0" + np.ascontiguousarray(obj).tobytes()
    else:
        yield path, normalize(repr(obj)).encode()


def checkpoint_hashes(path: Path, normalize) -> dict[str, str]:
    """``ckpt:<first DEPTH keys>`` -> SHA-256 of the (path, value) pairs below it."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  (our own file: a non-tensor object in it)
        state = torch.load(path, map_location="cpu", weights_only=False)
    groups: dict[str, Any] = {}
    for key, value in _leaves(state, (), normalize):
        group = "ckpt:" + "/".join(key[: 2 if key[0] == "callbacks" else DEPTH])
        digest = groups.setdefault(group, hashlib.sha256())
        digest.update("/".join(key).encode() + b"\0" + _sha(value).encode() + b"\n")
    return {k: v.hexdigest() for k, v in groups.items()}


def csv_hashes(root: Path, normalize) -> dict[str, str]:
    """``csv:<file>:<column>`` -> SHA-256 of the column's values as written (``<file>``: the file's name,
    or its path in the run folder where two files share a name)."""
    out = {}
    paths = sorted(p for p in root.rglob("*.csv") if "hf_cache" not in p.parts)
    names = [p.name for p in paths]
    for path in paths:
        name = path.name if names.count(path.name) == 1 else str(path.relative_to(root))
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            out[f"csv:{name}:"] = _sha(b"")
            continue
        for j, column in enumerate(rows[0]):
            values = [normalize(r[j]) if j < len(r) else None for r in rows[1:]]
            out[f"csv:{name}:{column}"] = _sha(json.dumps(values).encode())
    return out


def column_of(key: str) -> str:
    return key.rsplit(":", 1)[-1] if key.startswith("csv:") else key


def execute(run: Run, folder: Path) -> dict[str, Any]:
    """One run in ``folder``: {"keys": {key: sha256}} or {"error": last line}."""
    folder.mkdir(parents=True)
    fixtures = str(FIXTURES)

    def fill(arg: str) -> str:
        return arg.replace("<REPO>", str(REPO)).replace("<FIXTURES>", fixtures).replace("<RUN>", str(folder))

    def normalize(text: str) -> str:
        return text.replace(str(folder), "<RUN>").replace(fixtures, "<FIXTURES>").replace(str(REPO), "<REPO>")

    command = [sys.executable, "-m", "fl_lightning.commands.cli", "fit", *(fill(a) for a in run.args)]
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO), "HF_HOME": str(folder / "hf_home"),
           "FL_LIGHTNING_CACHE_DIR": str(folder / "answers")}  # fmt: skip
    (folder / "command.txt").write_text(shlex.join(command) + "\n")
    start = time.monotonic()
    try:
        with open(folder / "log.txt", "w") as log:
            proc = subprocess.run(command, cwd=folder, env=env, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RUN_TIMEOUT_S} s", "seconds": RUN_TIMEOUT_S}
    seconds = round(time.monotonic() - start, 1)
    lines = [line for line in (folder / "log.txt").read_text(errors="replace").splitlines() if line.strip()]
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: " + (lines[-1].strip() if lines else "no output"), "seconds": seconds}
    ckpt = folder / "fingerprint" / "last.ckpt"
    if not ckpt.is_file():
        return {"error": "no fingerprint/last.ckpt written", "seconds": seconds}
    keys = checkpoint_hashes(ckpt, normalize)
    keys.update(csv_hashes(folder, normalize))
    if not any(k.startswith("csv:") for k in keys):
        return {"error": "no CSV written", "seconds": seconds}
    return {"keys": keys, "seconds": seconds}


def digest(keys: dict[str, str], prefix: str, excluded: set[str]) -> str:
    kept = sorted(f"{k}={v}" for k, v in keys.items() if k.startswith(prefix) and column_of(k) not in excluded)
    return _sha("\n".join(kept).encode())


def entry(run: Run, keys: dict[str, str], unstable: list[str], seconds: list[float]) -> dict[str, Any]:
    return {"config": run.config, "args": run.args, "notes": run.notes, "unstable": unstable, "seconds": seconds,
            "keys": {k: v[:16] for k, v in sorted(keys.items())}}  # fmt: skip


def excluded_of(table: dict) -> set[str]:
    return {column_of(k) for e in table["runs"].values() for k in e.get("unstable", [])}


def finish(table: dict) -> dict:
    """Digests after exclusion of every key/column unstable in any run (keys are stored 16 hex digits long)."""
    excluded = excluded_of(table)
    table["excluded"] = sorted(excluded)
    for e in table["runs"].values():
        if "keys" in e:
            e["checkpoint_digest"] = digest(e["keys"], "ckpt:", excluded)
            e["metrics_digest"] = digest(e["keys"], "csv:", excluded)
    return table


def compare(old: dict[str, str], new: dict[str, str], excluded: set[str]) -> list[str]:
    names = sorted(set(old) | set(new))
    return [k for k in names if column_of(k) not in excluded and old.get(k, "")[:16] != new.get(k, "")[:16]]


def _short(keys: list[str]) -> str:
    shown = ", ".join(k.removeprefix("ckpt:") for k in keys[:8])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


def torch_version() -> str:
    import torch

    return torch.__version__


def check_importable() -> None:
    code = "import fl_lightning, fl_lightning.engine.module as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False).stdout.strip()  # fmt: skip
    if not out.startswith(str(REPO) + os.sep):
        raise SystemExit(f"config_hashes: {sys.executable} imports fl_lightning from {out or '?'}, not from {REPO}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"run everything twice, write {TABLE.name}")
    mode.add_argument("--check", action="store_true", help=f"run once, compare with {TABLE.name}; exit 1 on a difference")
    mode.add_argument("--list", action="store_true", help="list the runs and their arguments")
    parser.add_argument("--only", action="append", help="configs or runs matching this glob (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (kept anyway when a run fails)")
    ns = parser.parse_args(argv)
    check_importable()
    make_fixtures()
    runs = [r for r in all_runs() if not ns.only or any(fnmatch.fnmatch(r.config, g) or fnmatch.fnmatch(r.name, g) for g in ns.only)]
    if ns.list:
        for run in runs:
            print(run.name, shlex.join(run.args))
        return 0
    if not runs:
        raise SystemExit("config_hashes: no config matches --only")
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else None
    if ns.check and table is None:
        raise SystemExit(f"config_hashes: no {TABLE}; run --write first")
    work = Path(tempfile.mkdtemp(prefix="config_hashes_"))
    attempts = 2 if ns.write else 1
    start = time.monotonic()
    lock = threading.Lock()

    def one(item: tuple[int, Run]) -> tuple[Run, list[dict]]:
        i, run = item
        results: list[dict] = []
        for attempt in range(attempts):
            results.append(execute(run, work / f"{i:03d}" / str(attempt)))
            if "error" in results[-1]:
                break
        line = report_line(run, results)
        with lock:
            print(line, flush=True)
        return run, results

    def report_line(run: Run, results: list[dict]) -> str:
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            return f"{run.name}: failed ({errors[0]})"
        if ns.write:
            unstable = compare(results[0]["keys"], results[1]["keys"], set())
            return f"{run.name}: written ({results[0]['seconds']} s)" + (f"; unstable: {_short(unstable)}" if unstable else "")
        old = table["runs"].get(run.name)
        if old is None or "keys" not in old:
            return f"{run.name}: no baseline" + (f" (it failed: {old['error']})" if old else "")
        differ = compare(old["keys"], results[0]["keys"], set(table.get("excluded", [])))
        changed = " (its arguments changed since the baseline)" if old["args"] != run.args else ""
        return f"{run.name}: " + (f"DIFFERENT ({_short(differ)}){changed}" if differ else "equal")

    with ThreadPoolExecutor(max(1, ns.jobs)) as pool:
        done = list(pool.map(one, enumerate(runs)))
    elapsed = time.monotonic() - start
    bad = 0
    if ns.write:
        table = table if table is not None and ns.only else {"runs": {}}
        for run, results in done:
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                bad += 1
                table["runs"][run.name] = {"config": run.config, "args": run.args, "notes": run.notes, "error": errors[0]}
            else:
                unstable = compare(results[0]["keys"], results[1]["keys"], set())
                table["runs"][run.name] = entry(run, results[0]["keys"], unstable, [r["seconds"] for r in results])
        table["runs"] = dict(sorted(table["runs"].items()))
        table.update(rounds=ROUNDS, depth=DEPTH, fixtures_digest=fixtures_digest(),
                     python=sys.version.split()[0], torch=torch_version())  # fmt: skip
        TABLE.write_text(json.dumps(finish(table), indent=1) + "\n")
        print(f"wrote {TABLE}: {sum('keys' in e for e in table['runs'].values())} runs fingerprinted, "
              f"excluded {table['excluded']}, {elapsed:.0f} s")  # fmt: skip
    else:
        if table.get("fixtures_digest") != fixtures_digest():
            print(f"note: the fixtures in {FIXTURES} differ from the baseline's (delete the folder to rebuild them)")
        names = {run.name for run, _ in done}
        missing = 0 if ns.only else len(set(table["runs"]) - names)
        for name in [] if ns.only else sorted(set(table["runs"]) - names):
            print(f"{name}: missing (in the baseline, not among the runs of the current configs)")
        bad += missing
        for run, results in done:
            old = table["runs"].get(run.name)
            if any("error" in r for r in results) or old is None or "keys" not in old:
                bad += 1
                continue
            bad += bool(compare(old["keys"], results[0]["keys"], set(table.get("excluded", []))))
        print(f"{len(done) - (bad - missing)} of {len(done) + missing} runs equal, {elapsed:.0f} s")
    if bad or ns.keep:
        print(f"run folders kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

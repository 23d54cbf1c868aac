"""``fl-lightning tune --config STUDY.yaml --out DIR``: each method tuned on Optuna with the same budget, then its best
trial re-run on fresh seeds and scored on the test set once (docs/tuning.md).

Each method is one Optuna study (``<method>``) in one storage, by default ``DIR/study.db`` (SQLite; ``--storage`` any
Optuna storage URL), so a killed tune resumes where it stopped: a trial that was running in a process that no longer
lives is marked failed and its parameters are tried again, and the study stops at exactly ``trials`` complete or pruned
trials. Each trial is an ordinary fit (the study's base config plus the method's keys and the sampled values) in
``DIR/runs/<method>/trial<NNN>/``; the pruner reads the study's metric at each evaluation. The sampler is re-seeded
from the number of finished trials before each trial, so a resumed study samples what an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L

from fl_lightning.experiments.study import Method, Study, load_study
from fl_lightning.experiments.tune_report import budgets, check_validation_split, counts, report

HOST = socket.gethostname()


def _optuna():
    try:
        import optuna
    except ImportError as error:  # a dependency of fl-lightning; only a broken install lacks it
        raise ValueError("fl-lightning tune needs optuna (pip install 'optuna>=5')") from error
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats: stable in use since 2.9
    return optuna


class TrialPruning(L.Callback):
    """Reports ``metric`` to the trial at each evaluation and stops the fit when the pruner says so (after the
    round in progress); ``values``: (round, value) of every evaluation."""

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.values: list[tuple[int, float]] = []
        self.pruned = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.metric not in trainer.callback_metrics:
            return
        value, step = float(trainer.callback_metrics[self.metric]), int(trainer.global_step)
        self.values.append((step, value))
        if trainer.global_rank == 0 and math.isfinite(value):
            self.trial.report(value, step)
            self.pruned = self.trial.should_prune()
        self.pruned = bool(trainer.strategy.broadcast(self.pruned))  # every process stops together
        if self.pruned:
            trainer.should_stop = True


def sampler(spec: dict[str, Any], finished: int, methods: list[Method]):
    """The study's sampler, seeded by ``seed + finished`` (a resumed study samples what an uninterrupted one would)."""
    optuna = _optuna()
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    seed = int(kwargs.pop("seed", 0))
    name = spec["name"]
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed + finished, **kwargs)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed + finished)
    if name == "grid":
        space = {p.key: list(p.choices) for m in methods for p in m.space}
        return optuna.samplers.GridSampler(space, seed=seed + finished)
    return optuna.samplers.QMCSampler(seed=seed, **kwargs)  # one scrambled sequence, indexed by the study


def pruner(spec: dict[str, Any], rounds: int):
    optuna = _optuna()
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    name = spec["name"]
    if name == "median":
        return optuna.pruners.MedianPruner(**kwargs)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(**{"max_resource": rounds, **kwargs})
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(**kwargs)
    return optuna.pruners.NopPruner()


def storage(url: str):
    """The RDB storage with heartbeats: a trial whose process stops beating is failed and retried with its parameters."""
    optuna = _optuna()
    if not url.startswith(("sqlite", "postgresql", "mysql")):
        return url  # e.g. a journal storage object's URL form: Optuna resolves it
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)
    return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=180, heartbeat_stale_trial_callback=retry)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True  # not ours to judge: the heartbeat will
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(optuna_study: Any) -> list[int]:
    """Trials left running by a process of this machine that no longer lives: failed, their parameters enqueued again
    (the retry is the trial the killed one would have been). Returns their numbers."""
    optuna = _optuna()
    lost = []
    for trial in optuna_study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        attrs = trial.user_attrs
        if attrs.get("host") == HOST and not _alive(attrs.get("pid")):
            optuna_study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
            optuna_study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            lost.append(trial.number)
    return lost


class Tuner:
    """Runs a study's trials method by method (``run``), then its test runs (``test``)."""

    def __init__(self, study: Study, out: Path, storage_url: str | None = None, worker: int = 0) -> None:
        self.study, self.out, self.worker = study, out, worker  # ``worker``: this process's index under ``--jobs``
        self.storage_url = storage_url or f"sqlite:///{out / 'study.db'}"
        self.trials_seconds = 0.0
        self._storage: Any = None
        self._studies: dict[str, Any] = {}

    def optuna_study(self, name: str):
        """Method ``name``'s Optuna study, created or loaded once (one storage connection for the whole tune)."""
        if name not in self._studies:
            if self._storage is None:
                self._storage = storage(self.storage_url)
            self._studies[name] = _optuna().create_study(study_name=name, storage=self._storage, direction=self.study.direction,
                                                         pruner=pruner(self.study.pruner, self.study.methods[name].rounds),
                                                         load_if_exists=True)  # fmt: skip
        return self._studies[name]

    def run(self) -> None:
        for name, method in self.study.methods.items():
            optuna_study = self.optuna_study(name)
            lost = recover(optuna_study)
            if lost:
                print(f"[tune] {name}: trial(s) {lost} were left running by a stopped process: failed, run again", flush=True)
            while True:
                done = counts(optuna_study)
                finished = done["complete"] + done["pruned"]
                if finished + done["running"] >= method.trials:  # (several processes: the others' running trials count)
                    break
                # several workers: each its own stream (the same seed would sample the same point in each at once)
                optuna_study.sampler = sampler(self.study.sampler, finished + 7919 * self.worker, list(self.study.methods.values()))
                optuna_study.optimize(lambda trial: self.objective(trial, name), n_trials=1, catch=())
            done = counts(optuna_study)
            print(f"[tune] {name}: {done['complete']} complete, {done['pruned']} pruned, {done['fail']} failed trials", flush=True)

    def objective(self, trial: Any, name: str) -> float:
        optuna = _optuna()
        from fl_lightning.experiments.compare import _build, describe_failure

        started, cpu = time.perf_counter(), time.process_time()
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        method = self.study.methods[name]
        values = method.sample(trial)
        run_dir = self.study.trial_dir(self.out, name, trial.number)
        cli = _build(self.study.args(name, values, self.study.seed, run_dir))  # a bad sampled value recurs: it raises
        check_validation_split(cli.datamodule, self.study)
        pruning = TrialPruning(trial, self.study.metric)
        cli.trainer.callbacks.append(pruning)
        error = None
        try:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        except Exception as raised:  # noqa: BLE001  a diverged trial is a result: pruned at its last evaluation
            if type(raised).__name__ != "DivergenceError":
                raise
            error = describe_failure(raised)
        seconds = time.perf_counter() - started
        self.trials_seconds += seconds
        for key, value in {"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "rounds": int(cli.trainer.global_step)}.items():
            trial.set_user_attr(key, value)
        print(f"[tune] {name} trial {trial.number}: {_values_text(values)} -> {_outcome(pruning, error, self.study.metric)}", flush=True)
        if pruning.values and not pruning.pruned and error is None:
            return pruning.values[-1][1]
        if not pruning.values and error is None:
            logged = sorted(k for k in cli.trainer.callback_metrics if "/" in k)
            raise ValueError(f"study metric {self.study.metric!r} was never logged by the trials; logged: {logged}")
        if error is not None:
            trial.set_user_attr("error", error)
        raise optuna.TrialPruned(error or f"pruned at round {pruning.values[-1][0]}")

    def test(self, train: bool = True) -> dict[str, list[dict[str, Any]]]:
        """Each method's best trial on every test seed (reused where a finished run has the same arguments; ``train``
        False: only those)."""
        from fl_lightning.experiments.compare import INFO

        results = {}
        for name in self.study.methods:
            optuna_study = self.optuna_study(name)
            if not any(t.value is not None for t in optuna_study.get_trials(deepcopy=False, states=(_optuna().trial.TrialState.COMPLETE,))):
                print(f"[tune] {name}: no complete trial to test", flush=True)
                continue
            best = optuna_study.best_trial
            results[name] = []
            for seed in self.study.test_seeds:
                run_dir = self.study.test_dir(self.out, name, seed)
                args = self.study.args(name, best.params, seed, run_dir)
                info_path = run_dir / INFO
                saved = json.loads(info_path.read_text()) if info_path.is_file() else None
                if saved is not None and saved.get("args") == args:
                    results[name].append(saved)
                    continue
                if not train:
                    continue
                results[name].append(test_run(args, run_dir, info_path))
                info = results[name][-1]
                print(f"[tune] {name} best trial {best.number}, test seed {seed}: test acc "
                      f"{_percent(info.get('test_acc'))} ({info['status']})", flush=True)  # fmt: skip
        return results


def test_run(args: list[str], run_dir: Path, info_path: Path) -> dict[str, Any]:
    """One fit of a best trial's settings on a fresh seed, then the test set once; its ``run_info.json``."""
    from fl_lightning.experiments.compare import _build, describe_failure
    from fl_lightning.run.cli_app import test_after_fit

    info: dict[str, Any] = {"args": args, "status": "ok"}
    started = time.perf_counter()
    try:
        cli = _build(args)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        test_after_fit(cli.trainer, cli.model, cli.datamodule)
        metrics = cli.trainer.callback_metrics
        info.update(test_acc=float(metrics["test/acc"]) if "test/acc" in metrics else None,
                    val_acc=float(metrics["val/acc"]) if "val/acc" in metrics else None)  # fmt: skip
    except Exception as error:  # noqa: BLE001  a diverged test run is reported, not hidden
        info.update(status="failed", error=describe_failure(error))
    info["seconds"] = round(time.perf_counter() - started, 3)
    run_dir.mkdir(parents=True, exist_ok=True)
    info_path.write_text(json.dumps(info, indent=1))
    return info


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _values_text(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}" for k, v in values.items())


def _outcome(pruning: TrialPruning, error: str | None, metric: str) -> str:
    if error is not None:
        return error
    if not pruning.values:
        return f"{metric} not logged"
    round_, value = pruning.values[-1]
    return f"{'pruned at round %d, ' % round_ if pruning.pruned else ''}{metric} {value:.4f}"


def tune(config: str | Path, out: str | Path, storage_url: str | None = None, jobs: int = 1, test: bool = True) -> Study:
    """Check the study and its budget, run every method's trials (in ``jobs`` processes), test the best, report."""
    study, out = load_study(config), Path(out).resolve()
    lines = budgets(study, out)  # every method's config built once: a bad key stops here, before any trial
    for line in lines:
        print(line, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(Path(study.path).read_text())
    tuner = Tuner(study, out, storage_url)
    started = time.perf_counter()
    if jobs > 1:
        workers = [subprocess.Popen(worker_command(config, out, storage_url, index)) for index in range(jobs)]
        codes = [w.wait() for w in workers]
        if any(codes):
            raise SystemExit(max(codes))
    else:
        tuner.run()
        loop = time.perf_counter() - started
        if tuner.trials_seconds > 0:
            share = (loop - tuner.trials_seconds) / tuner.trials_seconds
            print(f"[tune] the tuning loop added {100 * share:.2f}% to the trials' own {tuner.trials_seconds:.1f} s", flush=True)
    tested = tuner.test() if test and study.test_seeds else {}
    for path in report(study, out, tuner, tested):
        print(f"[tune] wrote {path}", flush=True)
    return study


def worker_command(config: str | Path, out: Path, storage_url: str | None, index: int) -> list[str]:
    command = [sys.executable, "-m", "fl_lightning.experiments.tune", "--config", str(config), "--out", str(out), "--worker", str(index)]
    return command + (["--storage", storage_url] if storage_url else [])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fl-lightning tune",
        description="Tune every method of a study file on Optuna with the same budget, test each best trial on fresh seeds, "
        "and write summary.md, summary.csv, best_so_far.png and best/<method>.yaml into --out (docs/tuning.md).",
    )
    parser.add_argument("--config", required=True, help="study YAML (base, methods with set and space, trials, rounds, ...)")
    parser.add_argument("--out", required=True, help="output folder: study.db, runs/, the tables, plot and configs")
    parser.add_argument("--storage", default=None, help="an Optuna storage URL (default: sqlite:///OUT/study.db)")
    parser.add_argument("--jobs", type=int, default=1, help="processes working on the study at once (default 1)")
    parser.add_argument("--no-test", action="store_true", help="tune only: no test runs of the best trials")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the tables, plot and configs from the storage")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.jobs < 1:
        raise ValueError(f"--jobs must be an integer >= 1, got {ns.jobs}")
    if ns.worker is not None:
        study = load_study(ns.config)
        Tuner(study, Path(ns.out).resolve(), ns.storage, ns.worker).run()
        return
    if ns.report_only:
        study, out = load_study(ns.config), Path(ns.out).resolve()
        tuner = Tuner(study, out, ns.storage)
        for path in report(study, out, tuner, tuner.test(train=False)):
            print(f"[tune] wrote {path}", flush=True)
        return
    tune(ns.config, ns.out, ns.storage, ns.jobs, test=not ns.no_test)


if __name__ == "__main__":
    main(sys.argv[1:])

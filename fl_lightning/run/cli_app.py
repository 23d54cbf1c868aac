"""The LightningCLI behind ``fl-lightning fit|validate|test|predict`` (imported lazily by cli.py).

What it adds to LightningCLI:

- ``--lr_scheduler``: any ``torch.optim.lr_scheduler`` class, built on the algorithm's server
  optimizer and stepped once per round by ``ServerLRSchedule`` (which logs ``train/server_lr``).
  There is no ``--optimizer``: the server optimizer is the algorithm's (``Algorithm.server_optimizer``).
- the full parsed config as every logger's hyperparameters (wandb run config, CSV ``hparams.yaml``)
  and a ``config.yaml`` in every logger's own run directory (``ConfigToLoggers``);
- a default wandb run name ``<experiment>-<Algorithm>-seed<s>``;
- ``data.seed`` follows ``--seed_everything`` unless set explicitly;
- checkpoints load with ``weights_only=True`` unless ``--weights_only false``;
- a progress bar counted in rounds and a one-line result after ``fit`` (fl_lightning/run/terminal.py).
"""

from __future__ import annotations

import os
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple, SaveConfigCallback, instantiate_class
from torch.optim.lr_scheduler import ReduceLROnPlateau

from fl_lightning.run.setting_check import config_files
from fl_lightning.run.terminal import RoundProgressBar, RunSummary, quiet_lightning
from fl_lightning.run.threads import apply_threads, parse_threads

SERVER_LR = "train/server_lr"
OPTIMIZER_ERROR = (
    "--optimizer is not an fl-lightning setting: the server optimizer belongs to the algorithm "
    "(Algorithm.server_optimizer); set its learning rate with --model.algorithm.init_args.global_lr (> 0), "
    "choose an adaptive server with --model.algorithm (FedAdam, FedYogi, FedAvgM), "
    "and schedule the server lr per round with --lr_scheduler"
)

SEVERAL_PROCESSES_ERROR = (
    "--trainer.devices x --trainer.num_nodes = {processes} processes: compare and montecarlo run their fits one "
    "after another inside their own process, one process per fit; run a multi-process (DDP) fit with "
    "`fl-lightning fit --config FILE --trainer.strategy ddp ...` (docs/cluster.md)"
)


class SeveralProcesses(ValueError):
    """A multi-process trainer built without a subcommand (by compare or montecarlo): refused for the whole sweep."""


def _is_optimizer_flag(arg: Any) -> bool:
    return isinstance(arg, str) and (arg == "--optimizer" or arg.startswith(("--optimizer.", "--optimizer=")))


def _sets_optimizer(path: Path) -> bool:
    """Whether a config file sets ``optimizer`` (top level or under a subcommand)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False  # the parser reports unreadable files itself
    if not isinstance(data, dict):
        return False
    sections = [data, *(v for k, v in data.items() if k in ("fit", "validate", "test", "predict") and isinstance(v, dict))]
    return any(section.get("optimizer") is not None for section in sections)


class ServerLRSchedule(Callback):
    """Steps the server learning-rate scheduler(s) once per round, after the server step.

    Logs ``train/server_lr``, the server lr the round used, at the round's step. A
    ``ReduceLROnPlateau`` steps with the current value of its ``monitor`` metric (skipped
    while that metric has not been logged yet). The scheduler's state is checkpointed by
    Lightning, so a resumed run continues the schedule.
    """

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not trainer.optimizers:
            return
        lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        round_ = int(getattr(batch, "round", trainer.global_step - 1))
        for logger in trainer.loggers:
            logger.log_metrics({SERVER_LR: lr}, step=round_)
        import torch

        trainer.callback_metrics[SERVER_LR] = torch.tensor(lr)
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, ReduceLROnPlateau):
                monitor = getattr(scheduler, "monitor", None) or config.monitor
                value = trainer.callback_metrics.get(monitor) if monitor else None
                if value is not None:
                    scheduler.step(float(value))
            else:
                try:
                    scheduler.step()
                except (ZeroDivisionError, ValueError, OverflowError) as error:
                    from fl_lightning.core.errors import one_line

                    raise ValueError(f"--lr_scheduler {type(scheduler).__name__} failed at its first step ({one_line(error)}); check its settings") from None


class ConfigToLoggers(SaveConfigCallback):
    """Saves the run's config into every logger's own run directory and logs the full parsed config
    as every logger's hyperparameters.

    CSVLogger/TensorBoardLogger: ``<log_dir>/config.yaml`` beside ``metrics.csv`` and ``hparams.yaml``;
    WandbLogger: ``<run>/files/cli_config.yaml`` (synced with the run; wandb keeps its own
    ``files/config.yaml`` for the run config, which holds the same settings). Without a logger:
    ``<trainer.log_dir>/config.yaml``.
    """

    WANDB_FILENAME = "cli_config.yaml"
    written: list[str] = []  # the config files this process wrote (rank 0), rewritten at the fit's end

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        default_dir = trainer.log_dir  # a collective call under DDP: every rank makes it
        default_dir = str(getattr(self, "run_dir", None) or default_dir)  # no logger: <root>/version_N
        if stage != "fit" and any(os.path.isfile(p) for p in self.config_paths(trainer, default_dir)):
            self.already_saved = True  # validate/test/predict in a run's folder keep the config it trained with
            return
        if trainer.is_global_zero:
            self.written = self.config_paths(trainer, default_dir)
            for path in self.written:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.parser.save(self.config, path, skip_none=False, overwrite=True)
            config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
            config.pop("config", None)  # the paths of the config files, not a setting
            for logger in trainer.loggers:
                logger.log_hyperparams(config)
        self.already_saved = trainer.strategy.broadcast(True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A setting the run decided while training (``execution: auto``'s choice) written into the saved config,
        so that ``fit --config <run>/config.yaml`` reruns it exactly."""
        record = getattr(getattr(pl_module, "training_executor", None), "recorded_setting", None)
        setting = record() if callable(record) else None
        if setting is None or not trainer.is_global_zero:
            return
        for path in self.written:
            if os.path.isfile(path):
                with open(path) as f:
                    config = yaml.safe_load(f)
                config.setdefault("model", {})["execution"] = setting
                with open(path, "w") as f:
                    yaml.safe_dump(config, f, sort_keys=False)

    def config_paths(self, trainer: Trainer, default_dir: str | None) -> list[str]:
        paths = []
        for logger in trainer.loggers:
            kind = type(logger).__name__
            if kind == "WandbLogger":
                directory = getattr(logger.experiment, "dir", None)
                path = os.path.join(directory, self.WANDB_FILENAME) if directory else None
            else:
                directory = getattr(logger, "log_dir", None) or default_dir
                path = os.path.join(directory, self.config_filename) if directory else None
            if path and path not in paths:
                paths.append(path)
        if not paths and default_dir:
            paths.append(os.path.join(default_dir, self.config_filename))
        return paths


def _check_trainer(trainer: Any, fit: bool) -> None:
    """Trainer settings Lightning would refuse with a traceback (or accept and misread), as one line."""
    if trainer is None:
        return
    from fl_lightning.run.setting_ranges import refusal  # the ranges the early check uses (one table)

    devices = trainer.get("devices")
    for key in ("trainer.max_steps", "trainer.val_check_interval") if fit else ("trainer.val_check_interval",):
        line = refusal(key, trainer.get(key.partition(".")[2]))
        if line is not None:
            raise ValueError(line)
    if str(devices).strip() in ("0", "[]") or (isinstance(devices, int) and devices < -1):
        raise ValueError(f"--trainer.devices must be >= 1 (processes or GPUs), -1 or auto (all), got {devices}")
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    if accelerator in ("gpu", "cuda", "mps"):
        import torch

        found = torch.cuda.is_available() or (accelerator != "cuda" and torch.backends.mps.is_available())
        if not found:
            raise ValueError(f"--trainer.accelerator {accelerator}: this machine has no usable GPU; use --trainer.accelerator cpu (or auto)")
    if trainer.get("enable_checkpointing") is False and any("Checkpoint" in _class_name(c) for c in _entries(trainer.get("callbacks"))):
        raise ValueError(
            "--trainer.enable_checkpointing false, but trainer.callbacks holds a ModelCheckpoint (the config's); "
            "drop it too (--trainer.callbacks '[]') or leave checkpointing on"
        )


def _entries(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


POSITIVE_SCHEDULER_ARGS = {"StepLR": ("step_size",), "CosineAnnealingLR": ("T_max",), "CosineAnnealingWarmRestarts": ("T_0",)}


def _check_scheduler(scheduler: Any) -> None:
    """Scheduler arguments torch accepts and then divides by (a ZeroDivisionError at the first round's step)."""
    if scheduler is None or not hasattr(scheduler, "get"):
        return
    name, init_args = _class_name(scheduler), scheduler.get("init_args") or {}
    for arg in POSITIVE_SCHEDULER_ARGS.get(name, ()):
        value = init_args.get(arg) if hasattr(init_args, "get") else None
        if isinstance(value, (int, float)) and value < 1:
            raise ValueError(f"--lr_scheduler.{arg} of {name} must be >= 1 (rounds), got {value}")


def _size_settings(config: Any) -> str:
    """The hint for a model or data that does not fit in memory: its large integer settings."""
    large = []
    for section in ("model", "data"):
        node = config.get(section) if config is not None else None
        model = node.get("model") if section == "model" and node is not None else node
        init_args = model.get("init_args") if model is not None and hasattr(model, "get") else None
        for key, value in (dict(init_args.items()) if init_args is not None else {}).items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= 100_000:
                large.append(f"{section}{'.model' if section == 'model' else ''}.init_args.{key}={value}")
    return f"lower {', '.join(large)}" if large else "lower the model's size settings or the number of clients"


def _checked_checkpoint(config: Any) -> str:
    """``--ckpt_path`` as a file that exists: ``last`` (or ``latest``) is this experiment's newest
    ``last.ckpt`` among its loggers' ``<save_dir>/<name>/version_*/checkpoints``; a missing file is one line."""
    ckpt = str(config.get("ckpt_path"))
    if ckpt in ("last", "latest"):
        candidates = [path for _, root in _versioned_logs(config) for path in root.glob("version_*/checkpoints/last.ckpt")]
        if not candidates:
            raise ValueError(
                "--ckpt_path last: this experiment has no checkpoint yet (no <save_dir>/<name>/version_*/checkpoints/last.ckpt "
                "of its loggers); give the checkpoint's path, or start without --ckpt_path"
            )
        return str(max(candidates, key=lambda p: p.stat().st_mtime))
    if not Path(ckpt).is_file():
        raise ValueError(f"--ckpt_path {ckpt}: no such checkpoint file (or `last` for this experiment's newest)")
    if not zipfile.is_zipfile(ckpt):  # torch.save writes a zip archive: anything else is damaged or not a checkpoint
        raise ValueError(f"--ckpt_path {ckpt}: not a readable checkpoint (truncated, damaged, or not written by torch.save)")
    from fl_lightning.reliability.checkpoint_io import verify

    verify(ckpt)  # its recorded SHA-256 (or its archive's CRCs): a damaged checkpoint is refused before anything starts
    return ckpt


def _versioned_logs(config: Any) -> list[tuple[Any, Path]]:
    """``(init_args, <save_dir>/<name>)`` of the config's CSV and TensorBoard loggers (their ``version_N`` parent)."""
    roots = []
    for entry in _loggers(config.get("trainer")):
        init_args = entry.get("init_args") if hasattr(entry, "get") else None
        if init_args is not None and _class_name(entry) in ("CSVLogger", "TensorBoardLogger"):
            name = init_args.get("name")
            roots.append((init_args, Path(str(init_args.get("save_dir") or ".")) / (name if name is not None else "lightning_logs")))
    return roots


def _loggers(trainer_config: Any) -> list[Any]:
    logger = trainer_config.get("logger") if trainer_config is not None else None
    if logger is None or isinstance(logger, bool):
        return []
    return list(logger) if isinstance(logger, list) else [logger]


def _class_name(entry: Any) -> str:
    class_path = entry.get("class_path") if hasattr(entry, "get") else None
    return str(class_path or "").rsplit(".", 1)[-1]


class FLCli(LightningCLI):
    """LightningCLI over FederatedModule with the server lr schedule, config logging and round terminal."""

    def __init__(self, *args: Any, launch_args: list[Any] | None = None, **kwargs: Any) -> None:
        self.summary = RunSummary()
        self.launch_args = launch_args  # the command line other DDP ranks run (fl_lightning/run/launch.py)
        super().__init__(*args, auto_configure_optimizers=False, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # Only the scheduler: it is built on the algorithm's server optimizer (see after_instantiate_classes).
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        parser.add_argument("--base", type=Optional[str], default=None,
                            help="the config file this one overrides (fl_lightning/run/config_files.py)")  # fmt: skip
        parser.add_argument("--threads", type=Union[int, str], default="auto",
                            help="torch intra-op threads: auto (1 for models below 1M parameters, else all cores) "
                                 "or a count; results are bitwise reproducible per thread count (fl_lightning/run/threads.py)")  # fmt: skip

    def parse_arguments(self, parser, args) -> None:
        self.command_line = [a for a in args if isinstance(a, str)] if isinstance(args, list) else []
        if isinstance(args, list) and (
            any(_is_optimizer_flag(a) for a in args) or any(_sets_optimizer(f) for f in config_files(args))
        ):
            raise ValueError(OPTIMIZER_ERROR)
        _save_schema(parser, self.command_line)
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")  # checked before LightningCLI reads the checkpoint's hparams
        config = self.config.get(subcommand) if subcommand else None
        if config is not None and config.get("ckpt_path") is not None:
            config["ckpt_path"] = _checked_checkpoint(config)
        if config is not None:
            parse_threads(config.get("threads"))  # a bad value is one line before anything is built

    # ---- before instantiation: defaults that depend on other settings ------------------------
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        if self.subcommand is not None and "weights_only" in config and config.get("weights_only") is None:
            config["weights_only"] = True  # checkpoints never unpickle arbitrary objects unless asked
        seed = config.get("seed_everything")
        data = config.get("data")
        init_args = data.get("init_args") if data is not None and hasattr(data, "get") else None
        if init_args is not None and "seed" in init_args and init_args.get("seed") is None:
            init_args["seed"] = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
        self._name_wandb_runs(config)
        _check_trainer(config.get("trainer"), fit=self.subcommand == "fit")
        _check_scheduler(config.get("lr_scheduler"))
        self._one_run_folder(config)
        self._runs_before = self._run_folders(config)
        if self.subcommand is not None:  # fit resumes, validate/test/predict evaluate in the checkpoint's run folder
            self._resume_in_place(config)
        if self.subcommand == "fit":
            self._resume_wandb_run(config)
        self.trainer_defaults["callbacks"] = self._extra_callbacks(config)

    def _one_run_folder(self, config: Any) -> None:
        """Everything of a run under ``trainer.default_root_dir``: a ``--trainer.default_root_dir`` on the command
        line moves the CSV/TensorBoard logs too (``<root>/version_N``, unless the command line sets a ``save_dir``),
        a WandbLogger without a ``save_dir`` of the command line's writes its files there, and without a logger
        checkpoints and ``config.yaml`` go to ``<root>/version_N`` as with one."""
        trainer = config.get("trainer")
        root = trainer.get("default_root_dir") if trainer is not None else None
        self.run_dir = None
        if root is None:
            return
        line = getattr(self, "command_line", [])
        moved = any(a == "--trainer.default_root_dir" or a.startswith("--trainer.default_root_dir=") for a in line)
        own_save_dir = any("save_dir" in a for a in line)
        loggers = _loggers(trainer)
        for entry in loggers:
            init_args = entry.get("init_args") if hasattr(entry, "get") else None
            if init_args is None or own_save_dir:
                continue
            if _class_name(entry) in ("CSVLogger", "TensorBoardLogger") and moved:
                init_args["save_dir"], init_args["name"] = str(root), ""
            elif _class_name(entry) == "WandbLogger":
                init_args["save_dir"] = str(root)
        if trainer.get("logger") is False:
            self.run_dir = self._logless_run_dir(Path(str(root)), config.get("ckpt_path"))
            for entry in _entries(trainer.get("callbacks")):  # a list, or one callback given alone
                init_args = entry.get("init_args") if hasattr(entry, "get") else None
                if _class_name(entry) == "ModelCheckpoint" and init_args is not None and init_args.get("dirpath") is None:
                    init_args["dirpath"] = str(self.run_dir / "checkpoints")

    def _run_folders(self, config: Any) -> set[Path]:
        """The ``version_N`` folders this experiment's CSV/TensorBoard loggers (or its logless run) already have."""
        roots = [root for _, root in _versioned_logs(config)]
        if self.run_dir is not None:
            roots.append(Path(self.run_dir).parent)
        return {p.resolve() for root in roots for p in root.glob("version_*")}

    def _remove_empty_run_folders(self) -> None:
        """After a failed fit: the ``version_N`` folders this run created and wrote nothing to (no metric row, no
        checkpoint, no export; only its config.yaml/hparams.yaml) are removed, so that the next run is not
        numbered after a failure."""
        trainer, before = getattr(self, "trainer", None), getattr(self, "_runs_before", None)
        if trainer is None or before is None or not trainer.is_global_zero:
            return
        folders = [lg.log_dir for lg in trainer.loggers if type(lg).__name__ in ("CSVLogger", "TensorBoardLogger")]
        folders += [self.run_dir] if getattr(self, "run_dir", None) is not None else []
        for folder in folders:
            path = Path(str(folder)).resolve()
            if path.name.startswith("version_") and path.is_dir() and path not in before and _wrote_nothing(path):
                import shutil

                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _logless_run_dir(root: Path, ckpt: Any) -> Path:
        """``<root>/version_N`` of a run without a logger: the checkpoint's own folder, else the next free N."""
        if isinstance(ckpt, (str, Path)) and Path(ckpt).is_file():
            run_dir = Path(ckpt).resolve().parent.parent
            if run_dir.parent == root.resolve() and run_dir.name.startswith("version_"):
                return run_dir
        taken = [int(p.name[len("version_"):]) for p in root.glob("version_*") if p.name[len("version_"):].isdigit()]
        return root / f"version_{max(taken, default=-1) + 1}"

    @staticmethod
    def _resume_in_place(config: Any) -> None:
        """Resuming from ``<save_dir>/<name>/version_<N>/checkpoints/*.ckpt`` continues version N of that
        CSVLogger/TensorBoardLogger (one run, one folder of metrics) unless the config names a version."""
        ckpt = config.get("ckpt_path")
        if not isinstance(ckpt, (str, Path)) or not Path(ckpt).is_file():
            return
        run_dir = Path(ckpt).resolve().parent.parent
        if not run_dir.name.startswith("version_") or not run_dir.name[len("version_"):].isdigit():
            return
        for init_args, root in _versioned_logs(config):
            if init_args.get("version") is None and root.resolve() == run_dir.parent:
                init_args["version"] = int(run_dir.name[len("version_"):])
                # Lightning warns "Previous log files in this directory will be deleted": the rows are kept
                # (fit: fl_lightning/reliability/csv_resume.py; validate/test/predict: FLCli._keep_metrics)
                warnings.filterwarnings("ignore", message=".*Previous log files in this directory will be deleted.*")

    @staticmethod
    def _resume_wandb_run(config: Any) -> None:
        """Resuming from a checkpoint that recorded a wandb run continues that run (same id; Lightning's
        WandbLogger passes ``resume="allow"``) unless the config names an id or version of its own."""
        ckpt = config.get("ckpt_path")
        loggers = [e for e in _loggers(config.get("trainer")) if _class_name(e) == "WandbLogger" and e.get("init_args") is not None]
        if not loggers or not isinstance(ckpt, (str, Path)) or not Path(ckpt).is_file():
            return
        import torch

        try:  # memory-mapped: only the small record is read; a damaged file is reported by the real load
            trusted = config.get("weights_only") is False  # --weights_only false: the user trusts this file
            recorded = torch.load(ckpt, map_location="cpu", weights_only=not trusted, mmap=True).get("loggers") or {}
        except Exception:
            return
        run_id = recorded.get("wandb_run_id")
        for entry in loggers:
            init_args = entry.get("init_args")
            if run_id and init_args.get("id") is None and init_args.get("version") is None:
                init_args["id"] = str(run_id)

    def _experiment(self, config: Any) -> str:
        from fl_lightning.run.config_files import bases_named

        files = [Path(str(getattr(f, "relative", f))) for f in config.get("config") or [] if f is not None]
        bases = bases_named(files)  # inserted by `base:` expansion: the run is named after the file that names them
        stems = [f.stem for f in files if f.resolve() not in bases] or [f.stem for f in files]
        return stems[0] if stems else "fl-lightning"

    def _name_wandb_runs(self, config: Any) -> None:
        """A WandbLogger without a name of its own gets ``<experiment>-<Algorithm>-seed<s>``.

        A name equal to the experiment's (inherited by jsonargparse from the CSVLogger that
        ``--trainer.logger WandbLogger`` replaced, e.g. ``quickstart``) counts as no name.
        """
        experiment = self._experiment(config)
        algorithm = config.get("model", {}).get("algorithm")
        algorithm_name = _class_name(algorithm) or "FedAvg"
        seed = config.get("seed_everything")
        default = f"{experiment}-{algorithm_name}-seed{seed}"
        for entry in _loggers(config.get("trainer")):
            if _class_name(entry) != "WandbLogger":
                continue
            init_args = entry.get("init_args")
            if init_args is not None and init_args.get("name") in (None, "", experiment):
                init_args["name"] = default

    def _extra_callbacks(self, config: Any) -> list[Callback]:
        callbacks: list[Callback] = [self.summary]
        if config.get("lr_scheduler") is not None:
            callbacks.append(ServerLRSchedule())
        trainer = config.get("trainer") or {}
        user_callbacks = trainer.get("callbacks") or []
        user_callbacks = user_callbacks if isinstance(user_callbacks, list) else [user_callbacks]
        has_bar = any("ProgressBar" in _class_name(c) for c in user_callbacks)
        if trainer.get("enable_progress_bar") is not False and not has_bar:
            callbacks.append(RoundProgressBar())
        return callbacks

    def instantiate_classes(self) -> None:
        from fl_lightning.core.errors import is_out_of_memory, memory_failure

        try:
            super().instantiate_classes()
        except (MemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            config = self.config.get(str(self.subcommand), self.config)
            raise memory_failure(error, "building the model and data", _size_settings(config)) from error

    # ---- after instantiation: the server lr scheduler --------------------------------------
    def after_instantiate_classes(self) -> None:
        from fl_lightning.run.launch import install

        if self.subcommand is None and self.trainer.world_size > 1:
            raise SeveralProcesses(SEVERAL_PROCESSES_ERROR.format(processes=self.trainer.world_size))
        if self.launch_args is not None:
            install(self.trainer, self.launch_args)
        for callback in self.trainer.callbacks:
            if isinstance(callback, ConfigToLoggers):
                callback.run_dir = self.run_dir
        config = self.config.get(str(self.subcommand), self.config)
        model = getattr(self.model, "model", self.model)
        self.summary.threads = apply_threads(config.get("threads"), model)
        for logger in self.trainer.loggers:
            init = getattr(logger, "_wandb_init", None)
            if isinstance(init, dict) and init.get("anonymous") is None:
                # Lightning passes anonymous=None, which wandb >= 0.2x answers with a deprecation warning
                init.pop("anonymous", None)
        scheduler_init = self._get(self.config_init, "lr_scheduler")
        if not scheduler_init:
            return
        model = self.model
        server_optimizer = model.configure_optimizers  # the algorithm's server optimizer

        def configure_optimizers() -> Any:
            optimizer = server_optimizer()
            return [optimizer], [instantiate_class(optimizer, scheduler_init)]

        model.configure_optimizers = configure_optimizers

    def _run_subcommand(self, subcommand: str) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from fl_lightning.core.errors import FLError, is_out_of_memory, memory_failure

        try:
            if subcommand != "fit":
                self._keep_metrics()
            super()._run_subcommand(subcommand)
        except FLError:
            raise
        except (MemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            raise memory_failure(error, f"in `{subcommand}`", "lower the model's size, local.batch_size or the clients per round") from error
        except SIGTERMException as error:  # Lightning's stop between rounds: a SystemExit with code 0 otherwise
            stop = getattr(error, "interrupted", None)
            if stop is None:
                raise
            raise stop from None
        finally:
            failed = sys.exc_info()[0] is not None
            self._finish_wandb_runs(failed=failed)
            if failed and subcommand == "fit":
                self._remove_empty_run_folders()

    def _keep_metrics(self) -> None:
        """``validate``/``test``/``predict`` in a run's folder append to its ``metrics.csv`` (Lightning's CSV
        writer would start the file anew)."""
        from fl_lightning.reliability import csv_resume

        previous = csv_resume.read(self.trainer.loggers)
        if previous:
            csv_resume.continue_from(self.trainer.loggers, previous, step=sys.maxsize)

    def _finish_wandb_runs(self, failed: bool) -> None:
        """Close this process's wandb run before it exits, so that a resume can reopen it by id at once
        (a run left open by an exiting process is still "in use" for a moment)."""
        for logger in getattr(self.trainer, "loggers", []):
            experiment = getattr(logger, "_experiment", None)
            if type(logger).__name__ == "WandbLogger" and experiment is not None and hasattr(experiment, "finish"):
                experiment.finish(exit_code=1 if failed else 0)

    def after_fit(self) -> None:
        if test_after_fit(self.trainer, self.model, self.datamodule):
            test_acc, test_loss = (self.trainer.callback_metrics.get(k) for k in ("test/acc", "test/loss"))
            self.summary.test_acc = None if test_acc is None else float(test_acc)
            self.summary.test_loss = None if test_loss is None else float(test_loss)
        for callback in self.trainer.callbacks:
            exported = getattr(callback, "exported", None)
            if exported is not None:
                self.summary.exported = _shown(exported)
        if self.trainer.is_global_zero:
            print(self.summary.line(), flush=True)


def test_after_fit(trainer: Trainer, model: LightningModule, datamodule: Any) -> bool:
    """With a validation split, the final model on the test data once the fit has ended, whatever the evaluation
    interval: the global test set, and each client's test half (``test/personal_*``) where clients hold data out.
    Run by ``fit`` and by each run of ``compare``; False where it did not run."""
    if not getattr(datamodule, "val_fraction", 0) or trainer.interrupted:
        return False
    for callback in trainer.callbacks:
        if isinstance(callback, RoundProgressBar):
            callback.disable()  # the fit's bar has ended; the result line reports the test
    trainer.test(model, datamodule=datamodule, verbose=False)
    return True


def _wrote_nothing(folder: Path) -> bool:
    """Whether a run's folder holds only what is written before the first round: its config and hyperparameters,
    a metrics.csv without a row, empty subfolders."""
    for path in folder.rglob("*"):
        if path.is_dir():
            continue
        if path.name in ("config.yaml", "hparams.yaml"):
            continue
        if path.name == "metrics.csv" and len(path.read_text().strip().splitlines()) <= 1:
            continue
        return False
    return True


def _shown(path: Any) -> str:
    """``path`` relative to the working directory when it lies below it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _save_schema(parser: Any, args: list[str]) -> None:
    """What this subcommand accepts, for the next command's check before Lightning (fl_lightning/run/setting_check.py)."""
    from fl_lightning.run.setting_check import save_schema

    action = getattr(parser, "_subcommands_action", None)
    if action is not None and args and args[0] in action.choices:
        save_schema(args[0], action.choices[args[0]])


def build(args: list[str] | None = None, run: bool = True, exit_on_error: bool = True) -> FLCli:
    import fl_lightning.models  # noqa: F401  (registers model classes for short class names)
    from fl_lightning.datamodules import FederatedDataModule  # and the datamodule subclasses and partitioners
    from fl_lightning.engine.lifecycle import quiet_known_warnings
    from fl_lightning.engine.module import FederatedModule

    from fl_lightning.run.config_errors import OneLineParser, remember_args
    from fl_lightning.run.config_files import expand_bases
    from fl_lightning.package_names import refuse_old_names

    quiet_known_warnings()
    quiet_lightning()
    launch_args = list(args) if isinstance(args, list) else sys.argv[1:]
    args = expand_bases(args) if isinstance(args, list) else args
    remember_args(args)
    if isinstance(args, list):
        refuse_old_names(args)
    parser_kwargs = {} if exit_on_error else {"exit_on_error": False}
    return FLCli(
        FederatedModule,
        FederatedDataModule,
        subclass_mode_data=True,
        save_config_callback=ConfigToLoggers,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        parser_class=OneLineParser,
        args=args,
        run=run,
        launch_args=launch_args,
    )

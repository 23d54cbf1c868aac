"""SIGTERM and SIGINT end a run with a checkpoint of its last completed round.

The executors check ``ClientRuntime.should_stop`` between local steps and raise
``RunInterrupted`` (the unfinished round is not aggregated, so the module still holds the
state after the last completed round); between rounds Lightning raises its own
``SIGTERMException``. ``StopCheckpoint`` (added by ``FederatedModule.configure_callbacks``)
then writes ``last.ckpt`` into every ModelCheckpoint folder, so that nothing trained is lost
and ``--ckpt_path last`` continues the run. SIGINT (Ctrl+C) is handled like SIGTERM; a second
SIGINT interrupts at once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from fl_lightning.core.errors import RunInterrupted, one_line


class StopCheckpoint(Callback):
    """Turns SIGINT into a stop request and writes ``last.ckpt`` when the run stops on a signal."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # "SIGINT" once Ctrl+C was pressed
        self._previous: Any = None
        self._installed = False

    # ---- SIGINT: a stop request, like SIGTERM -------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        self._previous = signal.SIG_DFL if previous is None else previous  # None: a handler not set from Python

        def on_sigint(signum: int, frame: Any) -> None:
            if self.signal_name == "SIGINT":  # the second Ctrl+C: stop at once
                self._restore()
                raise KeyboardInterrupt
            self.signal_name = "SIGINT"
            connector = getattr(trainer, "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = True  # the stop request the executors and Lightning's loops check

        signal.signal(signal.SIGINT, on_sigint)
        self._installed = True

    def _restore(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    # ---- the checkpoint --------------------------------------------------------------------------
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return  # validate/test/predict: their state is a loaded checkpoint, never to overwrite a run's last.ckpt
        if isinstance(exception, SIGTERMException):  # between rounds: reported as a RunInterrupted (FLCli)
            stop = RunInterrupted(trainer.global_step, "before the round started")
            exception.interrupted = stop  # type: ignore[attr-defined]
        elif isinstance(exception, RunInterrupted):
            stop = exception
        else:
            return
        stop.signal_name = self.signal_name or "SIGTERM"
        self._restore()
        if trainer.world_size > 1:  # a checkpoint is a collective write: the ranks need not stop at the same place
            stop.unsaved = "no stop checkpoint under DDP (the ranks stop at different steps)"
            return
        written = None
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if not dirpath:
                continue
            path = os.path.join(str(dirpath), f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")
            try:
                trainer.save_checkpoint(path)
            except Exception as error:  # reported in the stop's line; the run is ending anyway
                stop.unsaved = f"writing the stop checkpoint {path} failed ({one_line(error)})"
                continue
            callback.last_model_path = path
            written = written or path
        if written is not None:
            stop.checkpoint = (written, trainer.global_step)
            release = getattr(pl_module, "_release_snapshots", None)
            if release is not None:
                release()

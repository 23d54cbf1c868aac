"""The run's Lightning hooks around the rounds: metrics kept across a resume, a stage's stop before a round
(a spent privacy budget), checkpoint snapshots released, a fit that trained nothing failed, the callbacks
every run gets (a mixin of ``FederatedModule``)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
import torch

from fl_lightning.core.participation import RoundPlan
from fl_lightning.reliability import csv_resume
from fl_lightning.reliability.faults import ClientError

log = logging.getLogger(__name__)


def quiet_known_warnings() -> None:
    """Silence Lightning warnings that do not apply to a round loop: the round-plan loader does no data work,
    a checkpoint taken after the server step is exactly the state to resume from, and under DDP every rank
    aggregates the same uploads and logs the same round metrics (nothing to sync)."""
    for message in (".*does not have many workers.*", ".*no pre-optimization state was saved.*",
                    ".*overridden `transfer_batch_to_device` in `LightningModule`.*", ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
                    ".*when logging on epoch level in distributed setting.*"):  # fmt: skip
        warnings.filterwarnings("ignore", message=message)


class RunLifecycle:
    """Of a module with ``store``, ``rounds`` (the round driver and its stages) and a trainer."""

    @property
    def training_executor(self):
        """The executor that trains the clients (``model.execution``), inside the round stages' wrappers."""
        return self._training_executor

    def prepare_data(self) -> None:
        self._previous_metrics = csv_resume.read(self.loggers)  # before Lightning's CSV writer deletes them

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self._stop_wanted() else None  # a run resumed with its budget spent: no round to run (it was evaluated then)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._release_snapshots()  # the checkpoint callbacks (run before this hook) have written their files
        if self.trainer.max_steps < 0 or self.trainer.global_step < self.trainer.max_steps:
            self._stop_wanted()  # a stop requested here, after the round, lets Lightning validate the final model

    def _stop_wanted(self) -> bool:
        """Whether a stage ends the run before another round (a spent privacy budget): one line, then ``should_stop``."""
        reason = None if self.trainer.should_stop else next((r for r in (s.wants_stop() for s in self.rounds.stages) if r), None)
        if reason is not None:
            log.warning(reason)
            self.trainer.should_stop = True
        return reason is not None

    def on_validation_end(self) -> None:
        self._release_snapshots()

    def _release_snapshots(self) -> None:
        self.store.release_snapshots([str(c.dirpath) for c in self.trainer.checkpoint_callbacks if getattr(c, "dirpath", None)])

    def on_train_end(self) -> None:
        self._release_snapshots()
        if self.rounds.rounds_run and not self.rounds.clients_trained:
            raise ClientError(
                f"no client completed its local training in {self.rounds.rounds_run} rounds: the model is untrained; "
                "see the warnings above for the clients' errors"
            )

    def configure_callbacks(self) -> list[L.Callback]:
        from fl_lightning.engine.personal_eval import PersonalizedEvaluation
        from fl_lightning.reliability.stopping import StopCheckpoint

        callbacks: list[L.Callback] = [StopCheckpoint()]  # SIGTERM/SIGINT end the run with a checkpoint of the last completed round
        if self.gc_freeze:
            from fl_lightning.engine.collector import CollectorFreeze

            callbacks.append(CollectorFreeze())
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        configured = any(isinstance(c, PersonalizedEvaluation) for c in getattr(self._trainer, "callbacks", None) or [])
        if getattr(data, "holdout_fraction", 0) > 0 and not configured:  # every run with per-client held-out data scores each
            callbacks.append(PersonalizedEvaluation())  # client's own model (one configured in trainer.callbacks keeps its settings)
        return callbacks

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, RoundPlan):  # client ids and seeds stay on the CPU: they index CPU-side data
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

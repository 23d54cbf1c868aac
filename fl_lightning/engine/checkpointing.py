"""Everything a resume needs, in the checkpoint's ``federated`` entry: the client store, the server state,
the communication totals, the run's fingerprint and each round stage's state (a mixin of ``FederatedModule``)."""

from __future__ import annotations

from typing import Any

from fl_lightning.core.errors import CheckpointError
from fl_lightning.core.state import ClientStore, flatten_state, unflatten_state
from fl_lightning.core.tasks import PERSONAL
from fl_lightning.reliability import csv_resume, fingerprint
from fl_lightning.reliability.faults import DivergenceError, all_finite, first_non_finite

CHECKPOINT_KEY = "federated"


class Checkpointing:
    """``on_save_checkpoint``/``on_load_checkpoint`` of a module with ``store``, ``server_state``,
    ``comm_totals``, ``algorithm``, ``model`` and its round ``rounds`` (driver and stages)."""

    def fingerprint(self) -> dict[str, Any]:
        """What a resume must match (``fl_lightning/reliability/fingerprint.py``)."""
        if self._schema is None:
            self._schema = fingerprint.schema(self.algorithm, self.model, self.global_params())
            for stage in self.rounds.stages:
                self._schema.update(stage.fingerprint())
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if data is None or not hasattr(data, "client_sizes"):
            return dict(self._schema)
        if self._partition is None or self._partition[0] is not data:
            self._partition = (data, fingerprint.partition_digest(data))
        return {**self._schema, "num_clients": int(data.num_clients), "partition": self._partition[1]}

    def _check_fingerprint(self, saved: dict[str, Any] | None, federated: dict[str, Any]) -> None:
        """Stop a resume whose checkpoint was written by a different run setup, naming what differs."""
        diffs = fingerprint.differences(saved, self.fingerprint(), federated.get("server_state", {}), type(self.algorithm).__name__)
        if diffs:
            path = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
            raise CheckpointError(
                f"checkpoint {path or ''} does not match this run: {'; '.join(diffs)}; "
                "resume with the settings it was written with, or start a new run without --ckpt_path"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == 0:
            csv_resume.flush(self.loggers)  # the rows of every round this checkpoint holds, on disk before it
        state = {"x": self.global_params(), **{f"server/{n}": td for n, td in (self.server_state or {}).items()}}
        if not all_finite([state]):
            raise DivergenceError(f"no checkpoint is written from a non-finite state ({first_non_finite(state)})")
        federated = {
            "client_store": self.store.checkpoint_state(self.global_step),
            "server_state": flatten_state(self.server_state or {}),
            "comm_totals": dict(self.comm_totals),
            "fingerprint": self.fingerprint(),
        }
        for part in (*self.rounds.stages, self.rounds, self._training_executor):  # a part without state writes nothing
            federated.update(part.checkpoint())
        checkpoint[CHECKPOINT_KEY] = federated
        wandb_ids = [str(logger.version) for logger in self.loggers if type(logger).__name__ == "WandbLogger" and logger.version]
        if wandb_ids:  # a resume continues this wandb run (fl_lightning/run/cli_app.py)
            checkpoint["loggers"] = {"wandb_run_id": wandb_ids[0]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            return
        self._check_fingerprint(state.get("fingerprint"), state)
        self._resumed_step = int(checkpoint.get("global_step", 0))
        self.store.load_checkpoint_state(state["client_store"])
        self.server_state = unflatten_state(state["server_state"])
        self.comm_totals = dict(state["comm_totals"])
        for stage in self.rounds.stages:
            stage.restore(state)
        self.rounds.restore(state, self._resumed_step, getattr(self._trainer, "ckpt_path", None))
        self._training_executor.restore(state)
        if state.get("personal_store"):  # checkpoints before personal tensors became client state
            legacy = ClientStore()
            legacy.load_state_dict(state["personal_store"])
            for cid in legacy.client_ids():
                self.store.put(cid, {**self.store.get(cid, dict), PERSONAL: legacy.get(cid, dict)["v"]})

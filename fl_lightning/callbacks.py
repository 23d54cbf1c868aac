"""Lightning callbacks for federated runs: cost-to-target and per-client evaluation.

Both act at evaluation time (after round ``trainer.global_step``) and log through the
module, so their scalars land in the same logger rows as ``val/acc``.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.fabric.utilities.apply_func import move_data_to_device

from fl_lightning.execution import forward_loss


def target_key(target: float, monitor: str = "val/acc") -> str:
    """Logged name of the round a target was first reached, e.g. ``target/val/acc>=0.8``."""
    return f"target/{monitor}>={target:g}"


class TargetAccuracy(Callback):
    """Records the first round at which ``monitor`` reaches each target (cost-to-target).

    The round is the number of completed rounds at that evaluation, so its resolution
    is ``trainer.val_check_interval``. On the evaluation that first reaches a target the
    round is logged as ``target/<monitor>>=<T>``; the record is in every checkpoint.

    Args:
        targets: values of ``monitor`` to reach (higher is better), e.g. ``[0.8, 0.9]``.
        monitor: the logged evaluation metric.
        stop: end training once the highest target is reached.
    """

    def __init__(self, targets: list[float], monitor: str = "val/acc", stop: bool = False) -> None:
        if not targets:
            raise ValueError("TargetAccuracy.targets must be a non-empty list of numbers")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in targets):
            raise ValueError(f"TargetAccuracy.targets must be finite numbers, got {targets}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"TargetAccuracy.targets must be distinct, got {targets}")
        self.targets = sorted(float(t) for t in targets)
        self.monitor = monitor
        self.stop = stop
        self.reached: dict[float, int] = {}

    @property
    def state_key(self) -> str:
        return f"TargetAccuracy[monitor={self.monitor}]"

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            available = sorted(k for k in trainer.callback_metrics if not k.startswith("target/"))
            raise ValueError(f"TargetAccuracy.monitor={self.monitor!r} is not logged at evaluation; logged: {available}")
        value, round_idx = float(value), int(trainer.global_step)
        for target in self.targets:
            if target not in self.reached and value >= target:
                self.reached[target] = round_idx
                pl_module.log(target_key(target, self.monitor), float(round_idx), on_step=False, on_epoch=True)
        if self.stop and len(self.reached) == len(self.targets):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"targets": list(self.targets), "reached": {str(t): r for t, r in self.reached.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reached = {float(t): int(r) for t, r in state_dict.get("reached", {}).items()}


class PerClientEvaluation(Callback):
    """Accuracy of the global model on each client's held-out data, at every evaluation.

    Logs ``clients/acc_mean``, ``clients/acc_worst10`` (mean over the worst 10% of
    clients, at least one), ``clients/acc_std`` (over clients) and writes the per-client
    table: a wandb Table for a ``WandbLogger``, and ``per_client_acc.csv`` in the log
    directory of any other logger (or the trainer's root directory without a logger).
    Needs the datamodule's ``holdout_fraction > 0``; clients whose held-out share rounds
    down to zero samples are left out.

    Args:
        clients: evaluate only the first this many clients (``None``: all).
    """

    def __init__(self, clients: int | None = None) -> None:
        if clients is not None and clients < 1:
            raise ValueError(f"PerClientEvaluation.clients must be >= 1 or null, got {clients}")
        self.clients = clients

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        data = trainer.datamodule
        if data is None or not hasattr(data, "client_holdout_batch"):
            raise ValueError("PerClientEvaluation needs a FederatedDataModule passed as `datamodule=`")
        if not getattr(data, "holdout_fraction", 0.0) > 0:
            raise ValueError(
                "PerClientEvaluation needs held-out client data: set data.init_args.holdout_fraction in (0, 1), "
                f"got {getattr(data, 'holdout_fraction', None)}"
            )

    @torch.no_grad()
    def client_accuracies(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[tuple[int, int, int]]:
        """(client id, held-out samples, correct predictions) of every evaluated client."""
        data = trainer.datamodule
        data.setup()
        count = data.num_clients if self.clients is None else min(self.clients, data.num_clients)
        rows = []
        for cid in range(count):
            if len(data.client_holdout[cid]) == 0:
                continue
            batch = move_data_to_device(data.client_holdout_batch(cid), pl_module.device)
            _, logits, target = forward_loss(pl_module.model, None, batch)
            rows.append((cid, len(target), int((logits.argmax(-1) == target).sum())))
        if not rows:
            raise ValueError(
                f"holdout_fraction={data.holdout_fraction} leaves every client without held-out samples; raise it"
            )
        return rows

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        rows = self.client_accuracies(trainer, pl_module)
        acc = torch.tensor([c / n for _, n, c in rows], dtype=torch.float64)
        worst = acc.sort().values[: max(1, math.ceil(0.1 * len(acc)))]
        pl_module.log_dict(
            {
                "clients/acc_mean": float(acc.mean()),
                "clients/acc_worst10": float(worst.mean()),
                "clients/acc_std": float(acc.std(unbiased=False)),
            },
            on_step=False,
            on_epoch=True,
        )
        self._write_table(trainer, [[trainer.global_step, cid, n, c, c / n] for cid, n, c in rows])

    def _write_table(self, trainer: L.Trainer, data: list[list[Any]]) -> None:
        if trainer.global_rank != 0:
            return
        columns = ["round", "client", "samples", "correct", "acc"]
        dirs = []
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="clients/acc_table", columns=columns, data=data)
            elif logger.log_dir is not None:
                dirs.append(logger.log_dir)
        if not trainer.loggers:
            dirs.append(trainer.default_root_dir)
        for log_dir in dict.fromkeys(dirs):
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "per_client_acc.csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(columns)
                writer.writerows(data)

"""Lightning callbacks for federated runs: cost-to-target, per-client evaluation, global cost.

Both act at evaluation time (after round ``trainer.global_step``) and log through the
module, so their scalars land in the same logger rows as ``val/acc``.
"""

from __future__ import annotations

import copy
import csv
import math
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device

from fl_lightning.core import params as P
from fl_lightning.core.objective import Objective
from fl_lightning.core.params import TensorDict


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
            _, logits, target = pl_module.objective(batch)
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


class GlobalCost(Callback):
    """The federated objective f(x) = (1/N) sum_n f_n(x) over every client's training data,
    evaluated after every round (Rostami & Kia, eq. 2; f_n is the client's mean loss plus the
    ``local.weight_decay`` term the clients optimize). Computed in float64.

    Logs ``train/global_cost`` (and ``train/cost_error`` = f(x) - f* with ``optimum=True``) and
    keeps ``history`` = [f(x^0), f(x^1), ...] and ``final_params`` for Monte Carlo studies.

    Args:
        optimum: also compute f* = min f by full-batch L-BFGS in float64 before the first round
            (exact to round-off for convex problems such as least squares).
        lbfgs_steps: outer L-BFGS iterations for f*.
    """

    def __init__(self, optimum: bool = False, lbfgs_steps: int = 5) -> None:
        self.optimum = optimum
        self.lbfgs_steps = lbfgs_steps
        self.history: list[float] = []
        self.optimal_cost: float | None = None
        self.optimal_params: TensorDict | None = None
        self.final_params: TensorDict | None = None
        self._objective64: Objective | None = None  # built from the module's model at the first evaluation

    @staticmethod
    def _batches(trainer: Trainer, pl_module: LightningModule) -> list:
        """Every client's full training batch on the module's device, floating tensors in float64."""
        data = trainer.datamodule

        def to_float64(t: torch.Tensor) -> torch.Tensor:
            return t.to(pl_module.device, torch.float64 if t.is_floating_point() else t.dtype)

        return [apply_to_collection(data.client_full_batch(cid), torch.Tensor, to_float64) for cid in range(data.num_clients)]

    def _objective(self, pl_module: LightningModule) -> Objective:
        """The module's objective on a float64 copy of its model; buffers and mode follow the live model."""
        if self._objective64 is None:
            self._objective64 = Objective(copy.deepcopy(pl_module.model).double(), pl_module.federated_names)
        model = self._objective64.model
        model.train(pl_module.model.training)
        with torch.no_grad():
            for mine, live in zip(model.buffers(), pl_module.model.buffers()):
                mine.copy_(live)
        return self._objective64

    def cost(self, pl_module: LightningModule, x: TensorDict, batches: list) -> torch.Tensor:
        """f(x): the mean over clients of the objective on the client's data, plus the weight decay term."""
        objective, wd = self._objective(pl_module), pl_module.local.weight_decay
        losses = []
        for batch in batches:
            loss = objective.at(x, batch)[0]
            losses.append(loss + 0.5 * wd * P.sq_norm(x) if wd else loss)
        return torch.stack(losses).mean()

    def _x(self, pl_module: LightningModule) -> TensorDict:
        return {n: v.double() for n, v in pl_module.global_params().items()}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._data = self._batches(trainer, pl_module)
        x0 = self._x(pl_module)
        if self.optimum:
            self.optimal_params, self.optimal_cost = self._minimize(pl_module, x0)
        if not self.history:
            self.history.append(float(self.cost(pl_module, x0, self._data)))

    def _minimize(self, pl_module: LightningModule, x0: TensorDict) -> tuple[TensorDict, float]:
        leaves = {n: v.clone().requires_grad_(True) for n, v in x0.items()}
        opt = torch.optim.LBFGS(list(leaves.values()), lr=1, max_iter=100, tolerance_grad=1e-14, tolerance_change=1e-16, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = self.cost(pl_module, leaves, self._data)
            loss.backward()
            return loss

        for _ in range(self.lbfgs_steps):
            opt.step(closure)
        with torch.no_grad():
            return {n: v.detach() for n, v in leaves.items()}, float(self.cost(pl_module, leaves, self._data))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        with torch.no_grad():
            value = float(self.cost(pl_module, self._x(pl_module), self._data))
        self.history.append(value)
        metrics = {"train/global_cost": value}
        if self.optimal_cost is not None:
            metrics["train/cost_error"] = value - self.optimal_cost
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.final_params = P.detach_clone(pl_module.global_params())

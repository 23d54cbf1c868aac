"""Evaluation callbacks for personalized federated learning.

``PersonalizedEvaluation``: each client's own model (what the algorithm says it predicts with)
on its own held-out data, for the training clients and for unseen ones; logs the mean, the
weighted mean and the worst 10% of clients.
``GradientNorm``: the stationarity measure of Chen, Cao, Yuan & Wen 2023 (arXiv:2309.17409; docs/algorithms.md §14), the gradient
of f(u, V) = (1/n) sum_i f_i(u, v_i) on all clients' training data.
Both run at every evaluation (``trainer.val_check_interval``).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer

from fl_lightning.core import params as P


CLIENTS_FILE = "personal_clients.csv"
"""Per client: id, samples, the global and the personal accuracy on its test half, seen or unseen (at test)."""


def worst_fraction_mean(values: torch.Tensor, fraction: float = 0.1) -> float:
    """Mean of the lowest ``ceil(fraction * n)`` values (at least one)."""
    k = max(1, math.ceil(fraction * len(values)))
    return float(values.sort().values[:k].mean())


def _client_params(module, client_id: int) -> dict:
    return {**module.global_params(), **module.client_personal(client_id)}


class ClientModels(Protocol):
    """What personalized evaluation reads: the objective, the device, and the parameters each client
    predicts with (``FederatedModule`` implements it)."""

    objective: Any
    device: torch.device

    def prediction_params(self, client_id: int) -> dict: ...

    def unseen_prediction_params(self, client_id: int) -> dict: ...


def client_scores(models: ClientModels, data: Any, clients: list[int], params_of, part: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Each client's (accuracy, loss, held-out size) with ``params_of(client)`` on its held-out split, or on its
    ``part`` of it (``"validation"``, ``"test"``)."""
    accs, losses, sizes = [], [], []
    for cid in clients:
        if len(data.client_holdout[cid] if part is None else data.client_holdout_part(cid, part)) == 0:
            continue
        params = params_of(cid)
        batch = move_data_to_device(data.client_holdout_batch(cid, part) if part else data.client_holdout_batch(cid), models.device)
        with torch.no_grad():
            loss, logits, target = models.objective.at(params, batch)
        accs.append((logits.argmax(-1) == target).double().mean())
        losses.append(loss.double())
        sizes.append(float(target.numel()))
    if not accs:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty, empty
    return torch.stack(accs).cpu(), torch.stack(losses).cpu(), torch.tensor(sizes, dtype=torch.float64)


def summary(prefix: str, accs: Tensor, losses: Tensor, sizes: Tensor) -> dict[str, float]:
    """``<prefix>_acc_mean`` (unweighted over clients), ``_acc_weighted`` (by held-out samples), ``_acc_worst10`` and
    ``_acc_best10`` (means of the worst and best 10% of clients), ``_acc_var`` (the unweighted variance across clients,
    ddof 0: the fairness measure of q-FFL, Li et al. 2020) and ``_loss_mean``; nothing for no client."""
    if not len(accs):
        return {}
    return {
        f"{prefix}_acc_mean": float(accs.mean()),
        f"{prefix}_acc_weighted": float((accs * sizes).sum() / sizes.sum()),
        f"{prefix}_acc_worst10": worst_fraction_mean(accs, 0.1),
        f"{prefix}_acc_best10": -worst_fraction_mean(-accs, 0.1),
        f"{prefix}_acc_var": float(accs.var(unbiased=False)),
        f"{prefix}_loss_mean": float(losses.mean()),
    }


class PersonalizedEvaluation(Callback):
    """Each client's own model on its own held-out split (``data.holdout_fraction > 0``), the protocol of
    docs/personalization.md ("Evaluation protocol"), at every evaluation and at test:

    - ``<stage>/personal_acc_mean``, ``_acc_weighted``, ``_acc_worst10``, ``_acc_best10``, ``_acc_var``, ``_loss_mean``: every training
      client, with the parameters it predicts with (the algorithm's ``personal_model`` of its stored state,
      then ``personalize_step``; FedAvg: the global model);
    - ``<stage>/unseen_acc_*`` likewise for the clients that never trained (``data.new_client_fraction``),
      each after one round of the algorithm's local training on its own training split.

    ``<stage>`` says which half of each client's held-out split it was measured on: ``val`` the validation half
    (for selection: "best" by ``val/personal_acc_mean``), ``test`` the test half (reported). Added to every run whose
    data has a held-out split (``FederatedModule.configure_callbacks``)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)

    @staticmethod
    def _check(pl_module) -> None:
        if not pl_module.datamodule.holdout_fraction > 0:
            raise ValueError("PersonalizedEvaluation needs data.holdout_fraction in (0, 1), got 0")

    @torch.no_grad()
    def evaluate(self, pl_module, part: str | None = None) -> dict[str, float]:
        data = pl_module.datamodule
        part = part if callable(getattr(data, "client_holdout_part", None)) else None
        metrics = summary("personal", *client_scores(pl_module, data, list(range(data.num_clients)), pl_module.prediction_params, part))
        unseen = list(getattr(data, "unseen_clients", []) or [])
        if unseen:
            metrics.update(summary("unseen", *client_scores(pl_module, data, unseen, pl_module.unseen_prediction_params, part)))
        return metrics

    def _log(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        for name, value in self.evaluate(pl_module, "validation" if stage == "val" else "test").items():
            pl_module.log(f"{stage}/{name}", value, on_step=False, on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "test")
        if trainer.is_global_zero:
            self.write_clients(trainer, pl_module)

    @torch.no_grad()
    def client_rows(self, pl_module) -> list[dict[str, Any]]:
        """Per client, on the test half of its held-out data: its id, samples, the global model's and its own
        prediction model's accuracy, and whether it trained (``seen``) or is an unseen client."""
        data = pl_module.datamodule
        x = pl_module.global_params()
        unseen = set(getattr(data, "unseen_clients", []) or [])
        rows = []
        for cid in sorted(set(range(data.num_clients)) | unseen):
            indices = data.client_holdout_part(cid, "test") if callable(getattr(data, "client_holdout_part", None)) else data.client_holdout[cid]
            if len(indices) == 0:
                continue
            own = pl_module.unseen_prediction_params(cid) if cid in unseen else pl_module.prediction_params(cid)
            batch = move_data_to_device(data.client_holdout_batch(cid, "test"), pl_module.device)
            scores = []
            for params in (x, own):
                _, logits, target = pl_module.objective.at(params, batch)
                scores.append(float((logits.argmax(-1) == target).double().mean()))
            rows.append({"client": cid, "samples": int(target.numel()), "global_acc": scores[0], "personal_acc": scores[1],
                         "seen": int(cid not in unseen)})  # fmt: skip
        return rows

    def write_clients(self, trainer: Trainer, pl_module) -> None:
        """``personal_clients.csv`` in the run's folder (``client_rows`` of the tested model)."""
        import csv
        import os

        run_dir = next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), None) or trainer.default_root_dir
        rows = self.client_rows(pl_module)
        if not rows or not run_dir:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, CLIENTS_FILE), "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


class GradientNorm(Callback):
    """Logs the gradient of f(u, V) = (1/n) sum_i f_i(u, v_i), f_i the full training loss of client i
    (weight decay and model penalties included):
    ``algo/grad_norm_u_sq`` = |grad_u f|^2, ``algo/grad_norm_v_sq`` = (1/n) sum_i |grad_{v_i} f_i|^2
    (G_u and G_v of Chen et al. 2023, docs/algorithms.md §14), ``algo/grad_norm_sq`` = their sum, ``algo/grad_norm`` = its root.
    Without personal tensors G_v = 0 and this is |grad f(x)|."""

    @torch.inference_mode(False)
    @torch.enable_grad()  # validation runs under inference mode
    def gradient_norms(self, pl_module) -> dict[str, float]:
        data, local = pl_module.datamodule, pl_module.local
        n = data.num_clients
        grad_u, g_v = None, torch.zeros((), dtype=torch.float64)
        for cid in range(n):
            batch = move_data_to_device(data.client_full_batch(cid), pl_module.device)
            params = _client_params(pl_module, cid)
            _, grads = pl_module.objective.grad_fn(batch, local.weight_decay)(params)
            shared = {k: grads[k].double() for k in pl_module.federated_names}
            grad_u = shared if grad_u is None else P.add(grad_u, shared)
            g_v = g_v + P.sq_norm({k: grads[k] for k in pl_module.personal_names})  # 0 without personal tensors
        g_u = P.sq_norm(P.scale(grad_u, 1.0 / n))
        g_v = g_v / n
        total = float(g_u + g_v)
        return {"grad_norm_u_sq": float(g_u), "grad_norm_v_sq": float(g_v), "grad_norm_sq": total, "grad_norm": math.sqrt(total)}

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for name, value in self.gradient_norms(pl_module).items():
            pl_module.log(f"algo/{name}", value, on_step=False, on_epoch=True, batch_size=1)

"""Evaluation callbacks for partial personalization.

``PersonalizedEvaluation``: each client's personalized model (global shared u plus
its own v_i) on its own held-out data; logs the mean and the worst 10% of clients.
``GradientNorm``: the stationarity measure of Chen, Cao, Yuan & Wen 2023 (arXiv:2309.17409; docs/algorithms.md §14), the gradient
of f(u, V) = (1/n) sum_i f_i(u, v_i) on all clients' training data.
Both run at every evaluation (``trainer.val_check_interval``).
"""

from __future__ import annotations

import math

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer

from fl_lightning.core import params as P


def worst_fraction_mean(values: torch.Tensor, fraction: float = 0.1) -> float:
    """Mean of the lowest ``ceil(fraction * n)`` values (at least one)."""
    k = max(1, math.ceil(fraction * len(values)))
    return float(values.sort().values[:k].mean())


def _client_params(module, client_id: int) -> dict:
    return {**module.global_params(), **module.client_personal(client_id)}


class PersonalizedEvaluation(Callback):
    """Logs ``<stage>/personal_acc_mean``, ``<stage>/personal_acc_worst10`` and ``<stage>/personal_loss_mean``:
    client i's model (u, v_i) on client i's held-out split (``data.holdout_fraction > 0``);
    unweighted over clients, worst10 = mean accuracy of the worst 10% of clients."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)

    @staticmethod
    def _check(pl_module) -> None:
        if not pl_module.datamodule.holdout_fraction > 0:
            raise ValueError("PersonalizedEvaluation needs data.holdout_fraction in (0, 1), got 0")

    @torch.no_grad()
    def evaluate(self, pl_module) -> dict[str, float]:
        data = pl_module.datamodule
        accs, losses = [], []
        for cid in range(data.num_clients):
            if len(data.client_holdout[cid]) == 0:
                continue
            batch = move_data_to_device(data.client_holdout_batch(cid), pl_module.device)
            loss, logits, target = pl_module.objective.at(_client_params(pl_module, cid), batch)
            accs.append((logits.argmax(-1) == target).double().mean())
            losses.append(loss.double())
        accs_t = torch.stack(accs).cpu()
        return {
            "personal_acc_mean": float(accs_t.mean()),
            "personal_acc_worst10": worst_fraction_mean(accs_t, 0.1),
            "personal_loss_mean": float(torch.stack(losses).mean()),
        }

    def _log(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        for name, value in self.evaluate(pl_module).items():
            pl_module.log(f"{stage}/{name}", value, on_step=False, on_epoch=True, batch_size=1)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module, "test")


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

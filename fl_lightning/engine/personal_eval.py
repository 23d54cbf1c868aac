"""Evaluation callbacks for personalized federated learning.

``PersonalizedEvaluation``: each client's own model (what the algorithm says it predicts with)
on its own held-out data, for the training clients and for unseen ones; logs the mean, the
weighted mean, the worst and best 10% of clients, the variance and the share below thresholds, and writes every
client's accuracy to ``clients.csv`` (``fl_lightning.engine.client_record``).
``GradientNorm``: the stationarity measure of Chen, Cao, Yuan & Wen 2023 (arXiv:2309.17409; docs/algorithms.md §14), the gradient
of f(u, V) = (1/n) sum_i f_i(u, v_i) on all clients' training data.
Both run at every evaluation (``trainer.val_check_interval``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.engine.client_record import ClientRecord

DEFAULT_BELOW = (0.5,)
"""The accuracy thresholds whose share of clients below is logged (``_acc_below50``)."""


def worst_fraction_mean(values: torch.Tensor, fraction: float = 0.1) -> float:
    """Mean of the lowest ``ceil(fraction * n)`` values (at least one)."""
    k = max(1, math.ceil(fraction * len(values)))
    return float(values.sort().values[:k].mean())


def below_name(threshold: float) -> str:
    """``acc_below50`` for 0.5: the metric of the share of clients below ``threshold``, named in percent."""
    return f"acc_below{100 * threshold:g}"


def _client_params(module, client_id: int) -> dict:
    return {**module.global_params(), **module.client_personal(client_id)}


class ClientModels(Protocol):
    """What personalized evaluation reads: the objective, the device, the global parameters and the parameters
    each client predicts with (``FederatedModule`` implements it)."""

    objective: Any
    device: torch.device

    def global_params(self) -> dict: ...

    def prediction_params(self, client_id: int) -> dict: ...

    def unseen_prediction_params(self, client_id: int) -> dict: ...


@dataclass(frozen=True)
class ClientScore:
    """One client on its held-out split: the accuracy and loss of the parameters it predicts with, and the global
    model's accuracy (the same number when the client predicts with the global model)."""

    client: int
    samples: int
    acc: float
    loss: float
    global_acc: float


def _same(a: dict, b: dict) -> bool:
    """Whether two parameter dicts hold the same values (views of one tensor compare without a pass over it)."""
    return a.keys() == b.keys() and all(a[k].data_ptr() == b[k].data_ptr() and a[k].shape == b[k].shape or torch.equal(a[k], b[k]) for k in a)


def client_scores(models: ClientModels, data: Any, clients: list[int], params_of, part: str | None = None) -> list[ClientScore]:
    """Each client's ``ClientScore`` with ``params_of(client)`` on its held-out split, or on its ``part`` of it
    (``"validation"``, ``"test"``); clients with no held-out sample there are left out."""
    x, scores = models.global_params(), []
    for cid in clients:
        if len(data.client_holdout[cid] if part is None else data.client_holdout_part(cid, part)) == 0:
            continue
        params = params_of(cid)
        batch = move_data_to_device(data.client_holdout_batch(cid, part) if part else data.client_holdout_batch(cid), models.device)
        with torch.no_grad():
            loss, logits, target = models.objective.at(params, batch)
            acc = float((logits.argmax(-1) == target).double().mean())
            global_acc = acc
            if not _same(params, x):  # a personalized model: the global one is scored too
                _, logits, target = models.objective.at(x, batch)
                global_acc = float((logits.argmax(-1) == target).double().mean())
        scores.append(ClientScore(cid, int(target.numel()), acc, float(loss.double()), global_acc))
    return scores


def summary(prefix: str, accs: Tensor, losses: Tensor, sizes: Tensor, below: tuple[float, ...] = DEFAULT_BELOW) -> dict[str, float]:
    """``<prefix>_acc_mean`` (unweighted over clients), ``_acc_weighted`` (by held-out samples), ``_acc_worst10`` and
    ``_acc_best10`` (means of the worst and best 10% of clients), ``_acc_var`` (the unweighted variance across clients,
    ddof 0: the fairness measure of q-FFL, Li et al. 2020), ``_acc_below<p>`` (the share of clients whose accuracy is
    below p %, for each threshold of ``below``) and ``_loss_mean``; nothing for no client."""
    if not len(accs):
        return {}
    return {
        f"{prefix}_acc_mean": float(accs.mean()),
        f"{prefix}_acc_weighted": float((accs * sizes).sum() / sizes.sum()),
        f"{prefix}_acc_worst10": worst_fraction_mean(accs, 0.1),
        f"{prefix}_acc_best10": -worst_fraction_mean(-accs, 0.1),
        f"{prefix}_acc_var": float(accs.var(unbiased=False)),
        **{f"{prefix}_{below_name(t)}": float((accs < t).double().mean()) for t in below},
        f"{prefix}_loss_mean": float(losses.mean()),
    }


def score_summary(prefix: str, scores: list[ClientScore], below: tuple[float, ...] = DEFAULT_BELOW) -> dict[str, float]:
    """``summary`` of ``client_scores``, in float64."""
    columns = [torch.tensor([getattr(s, k) for s in scores], dtype=torch.float64) for k in ("acc", "loss", "samples")]
    return summary(prefix, *columns, below)


class PersonalizedEvaluation(Callback):
    """Each client's own model on its own held-out split (``data.holdout_fraction > 0``), the protocol of
    docs/personalization.md ("Evaluation protocol"), at every evaluation and at test:

    - ``<stage>/personal_acc_mean``, ``_acc_weighted``, ``_acc_worst10``, ``_acc_best10``, ``_acc_var``,
      ``_acc_below<p>``, ``_loss_mean``: every training client, with the parameters it predicts with (the
      algorithm's ``personal_model`` of its stored state, then ``personalize_step``; FedAvg: the global model);
    - ``<stage>/unseen_acc_*`` likewise for the clients that never trained (``data.new_client_fraction``),
      each after one round of the algorithm's local training on its own training split;
    - every client's row in ``clients.csv`` in the run's folder (``fl_lightning.engine.client_record``).

    ``<stage>`` says which half of each client's held-out split it was measured on: ``val`` the validation half
    (for selection: "best" by ``val/personal_acc_mean``), ``test`` the test half (reported). Added to every run whose
    data has a held-out split (``FederatedModule.configure_callbacks``), unless ``trainer.callbacks`` has one.

    Args:
        below: the accuracy thresholds, each in (0, 1), whose share of clients below is logged
            (``_acc_below50`` for 0.5).
    """

    def __init__(self, below: float | list[float] = DEFAULT_BELOW[0]) -> None:
        thresholds = tuple(below) if isinstance(below, (list, tuple)) else (below,)
        if not all(isinstance(t, (int, float)) and 0 < t < 1 for t in thresholds):
            raise ValueError(f"PersonalizedEvaluation.below must be accuracies in (0, 1), got {below}")
        self.below = tuple(sorted({float(t) for t in thresholds}))
        self._record: ClientRecord | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:  # after a checkpoint's restore: global_step is the resumed round (0: a new fit)
            self._record = ClientRecord(pl_module._run_dir())
            self._record.start(trainer.global_step)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)
        if trainer.is_global_zero and self._record is None:  # a test alone appends to its folder's record
            self._record = ClientRecord(pl_module._run_dir())

    @staticmethod
    def _check(pl_module) -> None:
        if not pl_module.datamodule.holdout_fraction > 0:
            raise ValueError("PersonalizedEvaluation needs data.holdout_fraction in (0, 1), got 0")

    @torch.no_grad()
    def scores(self, pl_module, part: str | None = None) -> tuple[list[ClientScore], list[ClientScore]]:
        """The training clients' and the unseen clients' ``ClientScore`` on ``part`` of their held-out split."""
        data = pl_module.datamodule
        part = part if callable(getattr(data, "client_holdout_part", None)) else None
        seen = client_scores(pl_module, data, list(range(data.num_clients)), pl_module.prediction_params, part)
        unseen = list(getattr(data, "unseen_clients", []) or [])
        return seen, client_scores(pl_module, data, unseen, pl_module.unseen_prediction_params, part) if unseen else []

    def evaluate(self, pl_module, part: str | None = None) -> dict[str, float]:
        return self._summaries(*self.scores(pl_module, part))

    def _summaries(self, seen: list[ClientScore], unseen: list[ClientScore]) -> dict[str, float]:
        return {**score_summary("personal", seen, self.below), **score_summary("unseen", unseen, self.below)}

    def _log(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        seen, unseen = self.scores(pl_module, "validation" if stage == "val" else "test")
        for name, value in self._summaries(seen, unseen).items():
            pl_module.log(f"{stage}/{name}", value, on_step=False, on_epoch=True, batch_size=1)
        if self._record is not None:
            # the 0-based round the evaluation follows; a test alone (global_step 0) names its checkpoint's
            step = trainer.global_step or getattr(pl_module, "_resumed_step", None) or 0
            rows = [{"round": step - 1, "split": stage, "client": s.client, "samples": s.samples, "global_acc": s.global_acc,
                     "personal_acc": s.acc, "seen": int(is_seen)}
                    for is_seen, group in ((True, seen), (False, unseen)) for s in group]  # fmt: skip
            self._record.append(sorted(rows, key=lambda r: r["client"]))

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

"""Evaluation of the global model: loss and accuracy on the validation and test sets (token-level for a
language model), and a backdoor's attack success rate (a mixin of ``FederatedModule``)."""

from __future__ import annotations

from typing import Any

from torchmetrics import MeanMetric

from fl_lightning.adversary.base import split_batch


class GlobalEvaluation:
    """``validation_step``/``test_step`` of a module with ``objective``, ``attack`` and the metrics
    ``val_loss``, ``val_acc``, ``test_loss``, ``test_acc`` (``val_asr``/``test_asr`` with a backdoor)."""

    def _evaluate(self, batch: Any, loss_metric: MeanMetric, acc_metric: MeanMetric, prefix: str) -> None:
        if self.attack is not None and (prefix == "test" or not getattr(self.datamodule, "val_fraction", 0)):  # test inputs only
            self._backdoor_success(batch, getattr(self, f"{prefix}_asr", None))
        loss, logits, target = self.objective(batch)
        if self.objective.token_level:  # a language model: loss and accuracy over the scored tokens
            scored = target != -100
            loss_metric.update(loss, weight=scored.sum())
            acc_metric.update((logits.argmax(-1) == target)[scored].float())
        else:
            loss_metric.update(loss, weight=len(target))
            acc_metric.update((logits.argmax(-1) == target).float())
        kw = dict(on_step=False, on_epoch=True, add_dataloader_idx=False)
        self.log(f"{prefix}/loss", loss_metric, prog_bar=prefix == "val", **kw)
        self.log(f"{prefix}/acc", acc_metric, prog_bar=True, **kw)

    def _backdoor_success(self, batch: Any, metric: MeanMetric | None) -> None:
        """``attack/backdoor_asr``: the share of triggered test inputs of non-target classes predicted as the target."""
        if metric is None or self.attack.backdoor is None:
            return
        inputs, targets = self.attack.backdoor.triggered(*split_batch(batch))
        if len(targets):
            _, logits, target = self.objective((inputs, targets))
            metric.update((logits.argmax(-1) == target).float())
        self.log("attack/backdoor_asr", metric, on_step=False, on_epoch=True, add_dataloader_idx=False)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Loader 0 is the validation set; loader 1, when the data has a validation split, the test set."""
        if dataloader_idx == 0:
            self._evaluate(batch, self.val_loss, self.val_acc, "val")
        else:
            self._evaluate(batch, self.test_loss, self.test_acc, "test")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc, "test")

    def on_validation_epoch_end(self) -> None:
        if self.global_step > 0:  # the 0-based round the evaluation follows, on the evaluation's row too
            self.log("round", float(self.global_step - 1), on_step=False, on_epoch=True)
            if self.clock is not None:  # accuracy against simulated time reads it from the evaluation's own row
                self.log("time/sim_s", float(self.sim_time), on_step=False, on_epoch=True)

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()  # a test of the final (or a checkpoint's) model names its round too

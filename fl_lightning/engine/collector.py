"""Python's cyclic garbage collector kept off the run's long-lived objects (docs/performance.md, "The collector").

A run builds its long-lived objects in its first round: the model, the data, Lightning's loop and, with compiled
execution, the compiled programs (hundreds of thousands of Python objects). Every full collection the rounds'
allocations trigger afterwards scans all of them again, though none of them is garbage. ``gc.freeze()`` after
the warm-up round moves them to the permanent generation, which collections skip; objects made later are
collected as before. The fit's end unfreezes them, so a process that runs several fits (a sweep, the tests)
collects each finished run's objects.
"""

from __future__ import annotations

import gc

import lightning as L


class CollectorFreeze(L.Callback):
    """``gc.collect()`` then ``gc.freeze()`` once ``warmup_rounds`` rounds of this fit have run; ``gc.unfreeze()``
    when the fit ends (normally, by an exception or a stop). Changes no result: only which objects the collector scans."""

    def __init__(self, warmup_rounds: int = 1) -> None:
        self.warmup_rounds = warmup_rounds
        self.frozen = False
        self._start: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = trainer.global_step  # > 0 after a resume: the warm-up is this process's first rounds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.frozen and self._start is not None and trainer.global_step - self._start >= self.warmup_rounds:
            gc.collect()  # what is garbage now is not frozen with the rest
            gc.freeze()
            self.frozen = True

    def _unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._unfreeze()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._unfreeze()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._unfreeze()

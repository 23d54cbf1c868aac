"""The collector freeze (fl_lightning/engine/collector.py): frozen after the warm-up round, unfrozen when the fit
ends, normally or by an error, and off with ``gc_freeze=False``."""

from __future__ import annotations

import gc

import lightning as L
import pytest

from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


class FreezeCounts(L.Callback):
    def __init__(self, fail_at: int | None = None) -> None:
        self.counts, self.fail_at = [], fail_at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.counts.append(gc.get_freeze_count())
        if batch_idx == self.fail_at:
            raise RuntimeError("stop here")


def _fit(tmp_path, gc_freeze: bool, fail_at: int | None = None) -> list[int]:
    module = tiny_module()
    module.gc_freeze = gc_freeze
    counts = FreezeCounts(fail_at)
    tiny_trainer(tmp_path, rounds=3, callbacks=[counts]).fit(module, datamodule=tiny_datamodule())
    return counts.counts


def test_the_collector_is_frozen_after_the_warm_up_round_and_unfrozen_at_the_end(tmp_path):
    assert gc.get_freeze_count() == 0
    counts = _fit(tmp_path, gc_freeze=True)
    assert counts[0] == 0 and counts[1] > 0 and 0 < counts[2] <= counts[1]  # once, after round 0 (freed objects leave it)
    assert gc.get_freeze_count() == 0


def test_without_gc_freeze_nothing_is_frozen(tmp_path):
    assert _fit(tmp_path, gc_freeze=False) == [0, 0, 0]


def test_a_fit_that_fails_unfreezes(tmp_path):
    with pytest.raises(RuntimeError, match="stop here"):
        _fit(tmp_path, gc_freeze=True, fail_at=2)
    assert gc.get_freeze_count() == 0

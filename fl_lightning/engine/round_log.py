"""A round's row of metrics (``train/*``, ``comm/*``, the stages' metrics, ``time/round_s``), written straight
to the loggers at the round's index and made visible to callbacks (early stopping, targets)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from fl_lightning.core.metrics import consistency_from_sums, loss_term_means, payload_bytes, round_metrics
from fl_lightning.core.round_results import RoundResults
from fl_lightning.reliability import csv_resume


def round_row(round: Any, lr: float, uploads: Sequence[Any], results: Sequence[Any], comm_totals: dict[str, int], started: float,
              compile_seconds: float | None) -> dict[str, float]:  # fmt: skip
    """The metrics of ``round`` (a ``fl_lightning.rounds.Round``) from what its clients sent and reported."""
    results = RoundResults.of(results)
    from_sums: dict[str, Any] = {}
    summed = round.summed if results else None
    if summed is not None:  # the same numbers from the uploads' sizes and sums (to float tolerance)
        consistency = consistency_from_sums(summed.delta_sum, summed.delta_sq_sum, len(summed.results))
        from_sums = {"upload_bytes": summed.upload_bytes, "consistency": consistency}
    elif results:  # message stages' encoded sizes, or the bytes of each upload's tensors
        from_sums = {"upload_bytes": results.upload_bytes}
    if round.broadcast_bytes is not None or round.extra_bytes_down:
        broadcast = payload_bytes(round.broadcast) if round.broadcast_bytes is None else round.broadcast_bytes
        from_sums["broadcast_bytes"] = broadcast + round.extra_bytes_down
    metrics = round_metrics(round.plan.round, lr, results.mean_losses, uploads, round.broadcast, comm_totals, results.accuracies, **from_sums)
    metrics.update(loss_term_means(results.loss_terms))
    metrics.update({k: float(v) for k, v in round.metrics.items()})
    metrics["time/round_s"] = time.perf_counter() - started
    if compile_seconds is not None:  # compiled execution: seconds compiling so far
        metrics["time/compile_s"] = compile_seconds
    return metrics


def publish(trainer: Any, loggers: Sequence[Any], metrics: dict[str, float], step: int, rank: int) -> None:
    """Straight to the loggers (``self.log`` costs milliseconds per key, a real share of a small round), at the
    step Lightning gives this round's evaluation: the round index; then to the trainer's metric dicts."""
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
    if rank == 0:
        csv_resume.flush(loggers)  # metrics.csv holds every finished round (appends the new row)
    values = {k: torch.scalar_tensor(v) for k, v in metrics.items()}  # torch.tensor(v) of a float, at half its cost
    trainer.callback_metrics.update(values)
    trainer.logged_metrics.update(values)
    trainer.progress_bar_metrics["train/loss"] = metrics["train/loss"]

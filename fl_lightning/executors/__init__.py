"""Executors: how a round's client tasks are run (see ``docs/architecture.md``)."""

from __future__ import annotations

from fl_lightning.executors.base import ClientRuntime, Executor
from fl_lightning.executors.batched import BatchedExecutionError, BatchedExecutor, Unbatchable
from fl_lightning.executors.distributed import DistributedExecutor
from fl_lightning.executors.sequential import SequentialExecutor

EXECUTORS: dict[str, type[Executor]] = {"sequential": SequentialExecutor, "batched": BatchedExecutor}
"""Short names accepted by ``--model.execution``; any ``Executor`` is accepted by class path."""


def resolve_executor(execution: str | Executor) -> DistributedExecutor:
    """The executor for a short name or an ``Executor`` instance, wrapped for multi-process runs."""
    if isinstance(execution, str):
        if execution not in EXECUTORS:
            raise ValueError(f"execution must be one of {sorted(EXECUTORS)} or an Executor, got {execution!r}")
        execution = EXECUTORS[execution]()
    if not isinstance(execution, Executor):
        raise ValueError(f"execution must be one of {sorted(EXECUTORS)} or an Executor, got {type(execution).__name__}")
    return execution if isinstance(execution, DistributedExecutor) else DistributedExecutor(execution)


__all__ = [
    "EXECUTORS",
    "BatchedExecutionError",
    "BatchedExecutor",
    "ClientRuntime",
    "DistributedExecutor",
    "Executor",
    "SequentialExecutor",
    "Unbatchable",
    "resolve_executor",
]

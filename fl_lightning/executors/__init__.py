"""Executors: how a round's client tasks are run (see ``docs/architecture.md``).

May import: core, optim, algorithms, reliability.
"""

from __future__ import annotations

from fl_lightning.executors.auto import AutoExecutor
from fl_lightning.executors.base import ClientRuntime, Executor  # noqa: F401  (the contract, re-exported)
from fl_lightning.executors.batched import BatchedExecutionError, BatchedExecutor, Unbatchable  # noqa: F401
from fl_lightning.executors.distributed import DistributedExecutor
from fl_lightning.executors.sequential import SequentialExecutor

EXECUTORS: dict[str, type[Executor]] = {"sequential": SequentialExecutor, "batched": BatchedExecutor, "auto": AutoExecutor}
"""Short names accepted by ``--model.execution``; any ``Executor`` is accepted by class path."""


def resolve_executor(execution: str | Executor) -> DistributedExecutor:
    """The executor for a short name or an ``Executor`` instance, wrapped for multi-process runs."""
    executor = EXECUTORS[execution]() if isinstance(execution, str) and execution in EXECUTORS else execution
    if not isinstance(executor, Executor):
        from fl_lightning.core.errors import did_you_mean

        near = did_you_mean(execution, sorted(EXECUTORS)) if isinstance(execution, str) else ""
        raise ValueError(f"execution must be one of {sorted(EXECUTORS)} or an Executor, got {execution!r}{near}")
    return executor if isinstance(executor, DistributedExecutor) else DistributedExecutor(executor)


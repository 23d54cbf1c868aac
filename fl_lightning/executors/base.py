"""The executor contract: run a round's client tasks, return their results.

An executor receives the tasks (``fl_lightning.core.tasks``), the round's ``RoundInfo`` and a
``ClientRuntime`` naming everything it may use; it never sees the LightningModule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, DataPass, RoundInfo
from fl_lightning.core.client_data import ClientData
from fl_lightning.core.config import LocalTraining
from fl_lightning.reliability.faults import DivergenceError
from fl_lightning.core.objective import Objective
from fl_lightning.core.tasks import PERSONAL, ClientResult, ClientTask, Payload, SummedRound


@dataclass(frozen=True)
class ClientRuntime:
    """What client training may use, and nothing else.

    Attributes:
        algorithm: the client rule.
        objective: the model's forward and loss.
        data: the clients' data (``ClientData``).
        local: local training settings (batch size, steps or epochs, weight decay).
        device: where client tensors live.
        fail_fast: a client that raises stops the run instead of being left out of the round.
        personal_names: the model's personal tensors (kept per client, never sent).
        should_stop: whether the run was asked to stop (SIGTERM); executors check it between local steps.
        aggregation_weights: the aggregation weights of the reporting clients (their ids, in task
            order); an executor that sums the uploads itself (``run_summed``) weighs them with it.
        record_privacy: record-level DP-SGD settings (``fl_lightning.pipeline.record_privacy.RecordPrivacy``), or None:
            executors then draw each step's records and take (RDP.1) as ``ctx.grad`` (``fl_lightning.executors.dpsgd``).
    """

    algorithm: Algorithm
    objective: Objective
    data: ClientData
    local: LocalTraining
    device: torch.device
    fail_fast: bool = False
    personal_names: tuple[str, ...] = ()
    should_stop: Callable[[], bool] = lambda: False
    aggregation_weights: Callable[[Sequence[int]], Tensor] | None = None
    record_privacy: Any = None


class Executor:
    """Runs client tasks. Subclass it and implement ``run``; select it with
    ``--model.execution`` (a short name or a ``class_path``). ``DistributedExecutor``
    wraps any executor to split tasks over the processes of a DDP run.
    """

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> Sequence[ClientResult]:
        """Results of the tasks that completed, in task order (a failed client has none): a list, or
        ``RoundResults`` columns (``fl_lightning.core.round_results``: stacked, no object per client)."""
        raise NotImplementedError

    def run_summed(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> SummedRound | None:
        """For an algorithm that declares ``linear_aggregate``: run the tasks and return their uploads
        already summed, or None where this executor does not sum them (the module then calls ``run``
        and aggregates the uploads). ``DistributedExecutor`` sums across DDP processes."""
        return None

    runs_rounds = False
    """Whether ``run_round`` may run a whole round (``BatchedExecutor`` with ``compile_round``)."""

    def run_round(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime, server: Any) -> Any:
        """The round as one compiled program (``fl_lightning.executors.round_program.CompiledRound``): the clients, the
        aggregate and the server step, to commit once the stages admit it; None where it does not (the round then runs
        step by step). ``server``: ``ServerInputs``, or why the server step has no pure form."""
        return None

    # An executor with a state of its own, or settings a run can refuse, declares them here (``AutoExecutor``).
    def check(self, facts: Any) -> None:
        """Refuse the run (a ValueError naming the setting) before its first round; ``facts``: ``RunFacts``."""

    def describe(self) -> str | None:
        """The execution in words for the run's result line; None: nothing to add."""
        return None

    def checkpoint(self) -> dict:
        """Entries for the checkpoint's ``federated`` dict (names unique to this executor)."""
        return {}

    def restore(self, state: dict) -> None:
        """Read back what ``checkpoint`` wrote, from the checkpoint's ``federated`` dict."""


def to_device(batch: Any, device: torch.device) -> Any:
    return batch if device.type == "cpu" else move_data_to_device(batch, device)


def seed_client(seed: int, device: torch.device) -> None:
    """Seed model-internal randomness (dropout) from (seed, round, client).

    ``torch.manual_seed`` also queues a seed for every accelerator backend, which
    costs about a millisecond per call; on CPU only the CPU generator matters.
    """
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def check_loss(round_idx: int, client_id: int, loss: float) -> None:
    """A recorded non-finite training loss is divergence (``DivergenceError`` names round and client)."""
    if not math.isfinite(loss):
        raise DivergenceError(f"round {round_idx}: client {client_id}'s training loss is non-finite ({loss})")


def data_pass_fn(runtime: ClientRuntime, client_id: int) -> Callable[[dict], DataPass]:
    """``ctx.data_pass`` of one client: the model's outputs, representation included, on its whole
    training set at given parameters, without gradient (``fl_lightning.algorithms.base.DataPass``)."""

    def data_pass(params: dict) -> DataPass:
        batch = to_device(runtime.data.client_full_batch(client_id), runtime.device)
        with torch.no_grad():
            out, target = runtime.objective.outputs_at(params, batch, features=True)
        return DataPass(out.features, out.logits, target, torch.ones(target.shape[0], dtype=out.logits.dtype, device=target.device))

    return data_pass


def finish_client(algorithm: Algorithm, params: dict, local_state: Any, ctx: Any) -> tuple[Payload, Any]:
    """The client's (upload, new state): ``client_finish`` on the shared tensors (the broadcast's names) and,
    with personal tensors (``ctx.personal``), ``personal_finish``'s values kept under ``PERSONAL``. One client,
    or clients stacked on a leading dimension alike."""
    if not ctx.personal:
        return algorithm.client_finish(params, local_state, ctx)
    upload, new_state = algorithm.client_finish({k: params[k] for k in ctx.broadcast["x"]}, local_state, ctx)
    return upload, {**new_state, PERSONAL: algorithm.personal_finish(params, local_state, ctx)}

"""The synchronous round: the engine's steps with the stages' hooks between them (docs/architecture.md,
"Round stages"). Nothing here asks which mechanisms are present; each is a stage of the chain."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fl_lightning.algorithms.base import RoundInfo, declares_capability
from fl_lightning.core.client_data import ClientData
from fl_lightning.core.errors import CheckpointError
from fl_lightning.core.metrics import count_messages
from fl_lightning.core.participation import RoundPlan, derive_seeds
from fl_lightning.core.params import TensorDict
from fl_lightning.core.round_results import RoundResults
from fl_lightning.core.state import ClientStore, NestedState
from fl_lightning.core.tasks import ClientState, RoundTasks, TaskColumns
from fl_lightning.executors.base import ClientRuntime
from fl_lightning.pipeline.messages import is_message_state
from fl_lightning.reliability.faults import DivergenceError, first_non_finite, survivor_weights
from fl_lightning.rounds.round_states import RoundStates, store_results
from fl_lightning.rounds.stage import Cohort, Round, RoundStage

log = logging.getLogger(__name__)
WARMUP_STREAM = 0x3A4D
"""Seed stream of the warm-up pass: its samples xi^{-1} are fresh and addressable by client."""


class RoundHost(Protocol):
    """What a round driver needs from the engine (``FederatedModule`` implements it)."""

    algorithm: Any
    executor: Any
    store: ClientStore
    local: Any
    device: torch.device
    server_state: NestedState | None
    comm_totals: dict[str, int]

    @property
    def datamodule(self) -> ClientData: ...

    def global_params(self) -> TensorDict: ...

    def client_state(self, client_id: int, x: TensorDict) -> ClientState: ...

    def message_state(self, client_id: int) -> NestedState: ...

    def initial_personal(self) -> TensorDict: ...

    def runtime(self, aggregation_weights: Any = None, private: bool = True) -> ClientRuntime: ...

    def diverged(self, message: str, advice: str = ...) -> DivergenceError: ...

    def round_info(self, round_idx: int, plan: RoundPlan | None, personal: bool = True) -> RoundInfo: ...

    def apply_update(self, pseudo_grad: TensorDict | None) -> None: ...

    def log_round(self, round: Round, uploads: Sequence[Any], results: Sequence[Any]) -> None: ...

    def server_inputs(self, x: TensorDict, server_state: NestedState, weights: Any) -> Any: ...

    def commit_round(self, compiled: Any) -> None: ...


def local_steps(data: Any, clients: list[int], local: Any) -> list[int]:
    """Each client's K: the data's ``clients_num_local_steps`` (all at once) where it has one, else client by client."""
    many = getattr(data, "clients_num_local_steps", None)
    if many is not None:
        return many(clients, local.batch_size, local.steps, local.epochs)
    return [data.num_local_steps(c, local.batch_size, local.steps, local.epochs) for c in clients]


class SynchronousRounds:
    """Runs one round after another over ``stages`` (sorted by ``order``); counts the rounds run and the
    clients that trained (a fit that trained nothing fails)."""

    def __init__(self, stages: Sequence[RoundStage]) -> None:
        self.stages = sorted(stages, key=lambda s: s.order)
        self.summable = not any(s.reads_each_upload for s in self.stages)
        self.fusable = all(s.fusable for s in self.stages)  # the compiled round may run (fl_lightning.executors.round_program)
        self.through_sums = any(s.adds_to_sum for s in self.stages)
        self.rounds_run = self.clients_trained = 0

    def stage(self, name: str) -> RoundStage | None:
        return next((s for s in self.stages if s.name == name), None)

    # ---- one round -----------------------------------------------------------------------------
    def run(self, host: RoundHost, plan: RoundPlan) -> None:
        algorithm, data, stages = host.algorithm, host.datamodule, self.stages
        info = host.round_info(plan.round, plan)
        x = host.global_params()
        server_state = {n: {k: v.to(host.device) for k, v in td.items()} for n, td in host.server_state.items()}
        if algorithm.warmup_pass and plan.round == 0:
            server_state = self.warmup(host, x, server_state, info)
        broadcast = algorithm.broadcast(x, server_state, info)
        r = Round(plan, info, x, server_state, broadcast, data.seed, data.num_clients, algorithm, diverged=host.diverged)
        clients = plan.clients.tolist()
        r.full_steps = local_steps(data, clients, host.local)  # each client's K, here and only here
        for stage in stages:
            stage.on_broadcast(r)
        r.tasks = self.tasks(host, clients, plan.seeds.tolist(), r.broadcast, r, full=r.full_steps)
        # An algorithm whose aggregate is a sum over clients may get the uploads summed (DDP: partial sums
        # all-reduced, not gathered), unless a stage reads each upload; any other, or one process, gets every upload.
        linear = self.summable and declares_capability(algorithm, "linear_aggregate")
        weigh = next((w for w in (s.aggregation_weights(r) for s in stages) if w is not None), None)
        r.weights = weigh or functools.partial(survivor_weights, plan.clients, plan.weights)
        runtime = host.runtime(r.weights if linear else None)
        compiled = None
        try:
            if linear and self.fusable and host.executor.runs_rounds:  # the whole round as one compiled program
                compiled = host.executor.run_round(r.tasks, info, runtime, host.server_inputs(x, server_state, r.weights))
            r.summed = compiled.summed if compiled is not None else host.executor.run_summed(r.tasks, info, runtime) if linear else None
            r.results = RoundResults.of(r.summed.results if r.summed is not None else host.executor.run(r.tasks, info, runtime))
        except DivergenceError as error:  # a client's loss (the built-in executors check it)
            raise host.diverged(str(error)) from error
        self.rounds_run, self.clients_trained = self.rounds_run + 1, self.clients_trained + len(r.results)
        r.metrics.update({"faults/dropped": len(plan.clients) - len(r.tasks), "faults/failed": len(r.tasks) - len(r.results)})
        for stage in stages:
            stage.on_results(r)
        if not r.results:
            return self.empty(host, r)
        for stage in stages:
            stage.admit(r)
            if r.skipped is not None:  # e.g. fewer clients than the robust rule's assumption on f
                log.warning("round %d: skipped (nothing aggregated, no client state kept): %s", plan.round, r.skipped)
                return self.empty(host, r)
        if compiled is not None:  # aggregated in the program: committed now that the stages admitted the round
            pseudo_grad, host.server_state = None, compiled.server_state
        else:
            pseudo_grad, host.server_state = self.aggregate(host, r)
        r.metrics.update({f"algo/{k}": v for k, v in algorithm.metrics(host.server_state, info).items()})
        for stage in stages:
            stage.finish(r, len(r.results))
        store_results(host.store, r.results)
        if compiled is not None:
            host.commit_round(compiled)
        else:
            host.apply_update(pseudo_grad)
        for stage in stages:
            stage.after_step(r)
        bad = first_non_finite({"x": host.global_params()})
        if bad is not None:
            raise host.diverged(f"round {plan.round}: the global model became non-finite ({bad})")
        host.log_round(r, [] if r.summed is not None else r.results.uploads, r.results)

    def aggregate(self, host: RoundHost, r: Round) -> tuple[TensorDict, NestedState]:
        """The pseudo-gradient and new server state: from the summed uploads, a stage's combination, or the
        algorithm's aggregate; the stages' additions to the sum (an aggregate stage's noise)."""
        algorithm, results = host.algorithm, r.results
        local_steps, weights = results.num_steps, None
        if r.summed is not None:
            sums, uploads = r.summed.sums, []
        else:
            uploads, weights = results.uploads, r.weights(results.client_ids)
            sums = next((s for s in (stage.combine(r, weights) for stage in self.stages) if s is not None), None)
            if sums is None and self.through_sums:
                sums = algorithm.upload_sum(r.x, uploads, weights, r.info)
        if sums is None:
            return algorithm.aggregate(r.x, uploads, weights, r.server_state, r.info, local_steps)
        for stage in self.stages:
            sums = stage.add_to_sum(r, sums)
        return algorithm.aggregate_sum(r.x, sums, r.server_state, r.info, local_steps)

    def empty(self, host: RoundHost, r: Round) -> None:
        """No client reported, or the round was skipped: x, the server state and the client store stay as
        they are; the round is logged with ``train/clients = 0``."""
        host.apply_update(None)
        for stage in self.stages:
            stage.finish(r, 0)
        host.log_round(r, [], [])

    # ---- the cohort's tasks --------------------------------------------------------------------
    def tasks(self, host: RoundHost, clients: list[int], seeds: list[int], broadcast, r: Round | None, warmup: bool = False,
              full: list[int] | None = None) -> RoundTasks:  # fmt: skip
        """The client tasks as columns (``full``: each client's K, else computed here), shaped by the stages."""
        full = local_steps(host.datamodule, clients, host.local) if full is None else full
        cohort = Cohort(list(clients), list(seeds), list(full), list(full), broadcast, warmup)
        for stage in self.stages:
            stage.shape_cohort(r, cohort)
        init = functools.partial(host.algorithm.client_state_init, broadcast["x"])
        states = RoundStates(host.store, init, host.initial_personal, host.device, is_message_state)
        load_state = functools.partial(host.client_state, x=broadcast["x"])
        columns = TaskColumns(cohort.client_ids, cohort.seeds, cohort.budgets)
        return RoundTasks(columns, broadcast, load_state, warmup, host.message_state, states, cohort.own_broadcasts)

    def warmup(self, host: RoundHost, x: TensorDict, server_state: NestedState, info: RoundInfo) -> NestedState:
        """The algorithm's pass over all N clients before round 0 (e.g. Scaffold-P's c_i^0, c^0),
        run by the executor like any round's tasks."""
        algorithm, data = host.algorithm, host.datamodule
        broadcast, clients = algorithm.broadcast(x, server_state, info), list(range(info.num_clients))
        seeds = derive_seeds(data.seed, clients, WARMUP_STREAM).tolist()  # derive_seed(seed, cid, WARMUP_STREAM)
        tasks = self.tasks(host, clients, seeds, broadcast, None, warmup=True)
        results = host.executor.run(tasks, info, host.runtime())
        uploads = [r.upload for r in results]
        server_state = algorithm.server_warmup(x, uploads, server_state, info)
        store_results(host.store, results)
        count_messages(host.comm_totals, broadcast, uploads)
        return server_state


    def check(self, num_clients: int) -> None:
        """What the driver itself refuses before training (a synchronous round: nothing)."""

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        return {}

    def restore(self, saved: dict[str, Any], step: int, path: str | None) -> None:
        check_saved_driver(saved, step, path, asynchronous=False)


def check_saved_driver(saved: dict[str, Any], step: int, path: str | None, asynchronous: bool) -> None:
    """A checkpoint with rounds in it resumes only under the driver that wrote it (clients in flight or none)."""
    saved_async = "events" in saved.get("clock", {})
    if saved_async != asynchronous and step > 0:
        raise CheckpointError(
            f"checkpoint {path or ''} was written {'with' if saved_async else 'without'} model.asynchronous and this run is "
            f"{'without' if saved_async else 'with'} it; resume with the settings it was written with"
        )

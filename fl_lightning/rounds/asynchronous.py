"""The asynchronous round driver: FedBuff and FedAsync under the clock (docs/algorithms.md, 27), over
the same stages as a synchronous round (docs/architecture.md, "Round stages").

One Lightning training step is one server update. The step first fills the clients in flight up to
``concurrency`` from the current model version, then takes arrivals in order of simulated finish time
(27.5), sending each arrival's replacement the current version, until the buffer holds ``arrivals``
updates; then trains the buffered tasks (clients sent the same version run through the executor in one
call, stacked under batched execution), weighs each by its staleness (27.6)-(27.8) and applies the update
with the algorithm's aggregate and server optimizer. A client's training depends only on its version,
its seed and its data, so it runs when it arrives.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from fl_lightning.clock.asynchronous import AsyncAggregation
from fl_lightning.clock.devices import Devices
from fl_lightning.clock.events import DISPATCH_STREAM, EventQueue, InFlight, dispatch_draw
from fl_lightning.core import params as P
from fl_lightning.core.metrics import payload_bytes
from fl_lightning.core.participation import RoundPlan, derive_seed
from fl_lightning.core.round_results import RoundResults
from fl_lightning.core.tasks import ClientTask
from fl_lightning.reliability.faults import ClientFaults, DivergenceError, all_finite, first_non_finite
from fl_lightning.rounds.clock import SimulatedTime
from fl_lightning.rounds.driver import RoundHost, check_saved_driver
from fl_lightning.rounds.finite import TrainingLossCheck
from fl_lightning.rounds.stage import Round, RoundStage


class AsynchronousRounds:
    """``model.asynchronous``: each step one server update from the buffered arrivals. The stages' hooks it
    runs: ``on_broadcast`` (with the server version's broadcast) and ``finish``; the refusals of
    ``AsyncAggregation.check`` keep every stage whose other hooks matter out of such a run."""

    name: ClassVar[str] = "asynchronous"
    setting: ClassVar[str] = "model.asynchronous"
    conflicts: ClassVar[dict[str, str]] = {
        "privacy": "its accountant counts sampled synchronous rounds, not arrivals",
        "record_privacy": "its accountant counts synchronous rounds",
        "faults": "dropout and stragglers are synchronous rounds' faults (the clock's speeds and availability model them)",
        "clock": "needs model.clock, without a deadline (no round waits)",
        "secure_aggregation": "a masked sum needs a synchronous cohort",
        "messages": "uplink stages only (a compressed broadcast keeps one server copy per cohort; aggregate stages add per-round noise)",
    }

    def __init__(
        self, stages: Sequence[RoundStage], config: AsyncAggregation, time: SimulatedTime, faults: ClientFaults, losses: TrainingLossCheck
    ) -> None:
        self.stages = sorted(stages, key=lambda s: s.order)
        self.config, self.time, self.faults, self.losses = config, time, faults, losses
        self.events = EventQueue()  # clients in flight and their model versions
        self.rounds_run = self.clients_trained = 0

    def check(self, num_clients: int) -> None:
        """Concurrency plus the arrivals of one update must fit the population."""
        self.config.check_population(num_clients)

    def _dispatch(self, host: RoundHost, devices: Devices, x, version: int, bytes_down: int, bytes_up: int, waiting) -> None:
        """Send one idle client (not in flight, not in the buffer) the model version ``version`` at the current time."""
        data, local, events = host.datamodule, host.local, self.events
        busy = events.busy() | {e.client for e in waiting}
        client, tiebreak = dispatch_draw(data.seed, events.dispatched, data.num_clients, busy)
        steps = data.num_local_steps(client, local.batch_size, local.steps, local.epochs)
        start = devices.next_online(client, self.time.sim_time)
        finish = start + self.time.clock.task_seconds(devices, client, steps, bytes_down, bytes_up)
        events.push(InFlight(finish, tiebreak, events.dispatched, client, version, steps, start), x)

    def run(self, host: RoundHost, plan: RoundPlan) -> None:
        config, data, events, step, algorithm = self.config, host.datamodule, self.events, plan.round, host.algorithm
        x = host.global_params()
        server_state = {n: {k: v.to(host.device) for k, v in td.items()} for n, td in host.server_state.items()}
        info = host.round_info(step, None, personal=False)
        broadcast = algorithm.broadcast(x, server_state, info)
        devices = self.time.clock.devices(data.num_clients)
        sizes = (payload_bytes(broadcast), self.time.nominal_upload(x))
        buffer: list[InFlight] = []
        while len(events.heap) < config.concurrency:
            self._dispatch(host, devices, x, step, *sizes, buffer)
        while len(buffer) < config.arrivals:
            event = events.pop()
            self.time.sim_time = max(self.time.sim_time, event.finish)
            buffer.append(event)
            if len(buffer) < config.arrivals:
                self._dispatch(host, devices, x, step, *sizes, buffer)

        r = Round(plan, info, x, server_state, broadcast, data.seed, data.num_clients, algorithm, diverged=host.diverged)
        for stage in self.stages:
            stage.on_broadcast(r)
        results = {}
        try:
            for version in sorted({e.version for e in buffer}):  # one executor call per version: stacked when batched
                results.update(self._run_version(host, version, [e for e in buffer if e.version == version], server_state))
        except DivergenceError as error:
            raise host.diverged(str(error)) from error
        arrived = [(e, results[e.index]) for e in buffer if e.index in results]
        self.faults.check_failures(step, len(buffer) - len(arrived), len(buffer))
        self.rounds_run, self.clients_trained = self.rounds_run + 1, self.clients_trained + len(arrived)
        taus = [step - e.version for e in buffer]
        r.metrics.update({
            "time/sim_s": self.time.sim_time, "faults/failed": len(buffer) - len(arrived), "async/staleness_mean": sum(taus) / len(taus),
            "async/staleness_max": max(taus), "async/versions_held": len(events.versions),
        })  # fmt: skip
        if not arrived:
            events.release()
            host.apply_update(None)
            for stage in self.stages:
                stage.finish(r, 0)
            return host.log_round(r, [], [])
        uploads = [res.upload for _, res in arrived]
        if config.mode == "fedasync":  # x_i - x = x_{v_i} + delta_i - x: the arrival's model against the current one (27.8)
            uploads = [{**u, "delta": P.sub(P.add(events.versions[e.version], u["delta"]), x)} for (e, _), u in zip(arrived, uploads)]
        events.release()
        if not all_finite(uploads):
            bad = next((e.client, first_non_finite(u)) for (e, _), u in zip(arrived, uploads) if first_non_finite(u))
            raise host.diverged(f"server update {step}: client {bad[0]} sent a non-finite update ({bad[1]})")
        self.losses.check_growth(step, [res.mean_loss for _, res in arrived], host.diverged)
        weights = torch.tensor([config.weight(step - e.version) for e, _ in arrived], dtype=torch.float64)
        local_steps = [res.num_steps for _, res in arrived]
        pseudo_grad, host.server_state = algorithm.aggregate(x, uploads, weights, server_state, info, local_steps)
        for stage in self.stages:
            stage.finish(r, len(arrived))
        for _, result in arrived:
            host.store.put(result.client_id, result.client_state)
        host.apply_update(pseudo_grad)
        bad = first_non_finite({"x": host.global_params()})
        if bad is not None:
            raise host.diverged(f"server update {step}: the global model became non-finite ({bad})")
        r.results = RoundResults.of([res for _, res in arrived])
        host.log_round(r, uploads, r.results)

    def _run_version(self, host: RoundHost, version: int, group: list[InFlight], server_state) -> dict:
        """Train the buffered clients sent ``version``, in one executor call; their results by dispatch index."""
        data = host.datamodule
        info = host.round_info(version, None, personal=False)
        broadcast = host.algorithm.broadcast(self.events.versions[version], server_state, info)
        tasks = []
        for e in group:
            load_state = functools.partial(host.client_state, e.client, broadcast["x"])
            load_messages = functools.partial(host.message_state, e.client)
            seed = derive_seed(data.seed, e.index, e.client, DISPATCH_STREAM)
            tasks.append(ClientTask(e.client, seed, e.steps, broadcast, load_state, False, load_messages))
        index_of = {e.client: e.index for e in group}
        return {index_of[r.client_id]: r for r in host.executor.run(tasks, info, host.runtime())}

    # ---- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        return {"clock": {"sim_time": self.time.sim_time, "events": self.events.state_dict()}}

    def restore(self, saved: dict[str, Any], step: int, path: str | None) -> None:
        check_saved_driver(saved, step, path, asynchronous=True)
        if "clock" in saved:
            self.time.sim_time = float(saved["clock"]["sim_time"])
            self.events = self.config.events_from(saved["clock"]["events"])

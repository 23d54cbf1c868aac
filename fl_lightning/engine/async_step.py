"""The asynchronous server's training step: FedBuff and FedAsync under the clock (docs/algorithms.md, 27).

A mixin of ``FederatedModule``: one Lightning training step = one server update. The step first fills
the clients in flight up to ``concurrency`` from the current model version, then takes arrivals in
order of simulated finish time (27.5), sending each arrival's replacement the current version, until
the buffer holds ``arrivals`` updates; then trains the buffered tasks (clients sent the same version
run through the executor in one call, stacked under batched execution), weighs each by its
staleness (27.6)-(27.8) and applies the update with the algorithm's aggregate and server optimizer.
A client's training depends only on its version, its seed and its data, so it runs when it arrives.
"""

from __future__ import annotations

import functools

import torch

from fl_lightning.algorithms import RoundInfo
from fl_lightning.clock.devices import Devices
from fl_lightning.clock.events import DISPATCH_STREAM, EventQueue, InFlight, dispatch_draw
from fl_lightning.core import params as P
from fl_lightning.core.metrics import payload_bytes
from fl_lightning.core.participation import RoundPlan, derive_seed
from fl_lightning.core.tasks import ClientTask
from fl_lightning.reliability.faults import DivergenceError, all_finite, first_non_finite


class AsyncServer:
    """``_async_step`` of a module with ``clock``, ``asynchronous`` and ``_events`` (an ``EventQueue``)."""

    def _dispatch(self, events: EventQueue, devices: Devices, x, version: int, bytes_down: int, bytes_up: int, waiting) -> None:
        """Send one idle client (not in flight, not in the buffer) the model version ``version`` at the current time."""
        data, local = self.datamodule, self.local
        busy = events.busy() | {e.client for e in waiting}
        client, tiebreak = dispatch_draw(data.seed, events.dispatched, data.num_clients, busy)
        steps = data.num_local_steps(client, local.batch_size, local.steps, local.epochs)
        start = devices.next_online(client, self.sim_time)
        finish = start + self.clock.task_seconds(devices, client, steps, bytes_down, bytes_up)
        events.push(InFlight(finish, tiebreak, events.dispatched, client, version, steps, start), x)

    def _async_step(self, plan: RoundPlan) -> None:
        config, data, events, step = self.asynchronous, self.datamodule, self._events, plan.round
        x = self.global_params()
        server_state = {n: {k: v.to(self.device) for k, v in td.items()} for n, td in self.server_state.items()}
        info = RoundInfo(step, self.local.lr_at(step), data.num_clients, None, None)
        broadcast = self.algorithm.broadcast(x, server_state, info)
        devices = self.clock.devices(data.num_clients)
        sizes = (payload_bytes(broadcast), self._nominal_upload(x))
        buffer: list[InFlight] = []
        while len(events.heap) < config.concurrency:
            self._dispatch(events, devices, x, step, *sizes, buffer)
        while len(buffer) < config.arrivals:
            event = events.pop()
            self.sim_time = max(self.sim_time, event.finish)
            buffer.append(event)
            if len(buffer) < config.arrivals:
                self._dispatch(events, devices, x, step, *sizes, buffer)

        if self.messages:
            self.messages.begin_round(info)
        results = {}
        try:
            for version in sorted({e.version for e in buffer}):  # one executor call per version: stacked when batched
                results.update(self._run_version(events, version, [e for e in buffer if e.version == version], server_state))
        except DivergenceError as error:
            raise self._diverged(str(error)) from error
        arrived = [(e, results[e.index]) for e in buffer if e.index in results]
        self.faults.check_failures(step, len(buffer) - len(arrived), len(buffer))
        self._rounds_run, self._clients_trained = self._rounds_run + 1, self._clients_trained + len(arrived)
        taus = [step - e.version for e in buffer]
        extra = {
            "time/sim_s": self.sim_time, "faults/failed": len(buffer) - len(arrived), "async/staleness_mean": sum(taus) / len(taus),
            "async/staleness_max": max(taus), "async/versions_held": len(events.versions),
        }  # fmt: skip
        if not arrived:
            events.release()
            self._empty_round(plan, broadcast, extra)
            return
        uploads = [r.upload for _, r in arrived]
        if config.mode == "fedasync":  # x_i - x = x_{v_i} + delta_i - x: the arrival's model against the current one (27.8)
            uploads = [{**u, "delta": P.sub(P.add(events.versions[e.version], u["delta"]), x)} for (e, _), u in zip(arrived, uploads)]
        events.release()
        if not all_finite(uploads):
            bad = next((e.client, first_non_finite(u)) for (e, _), u in zip(arrived, uploads) if first_non_finite(u))
            raise self._diverged(f"server update {step}: client {bad[0]} sent a non-finite update ({bad[1]})")
        self._check_loss_growth(step, [r.mean_loss for _, r in arrived])
        weights = torch.tensor([config.weight(step - e.version) for e, _ in arrived], dtype=torch.float64)
        local_steps = [r.num_steps for _, r in arrived]
        pseudo_grad, self.server_state = self.algorithm.aggregate(x, uploads, weights, server_state, info, local_steps)
        if self.messages:
            extra.update(self.messages.end_round(info, len(arrived)))
        for _, result in arrived:
            self.store.put(result.client_id, result.client_state)
        for name, param in zip(self.federated_names, self.federated_parameters()):
            param.grad = pseudo_grad[name].to(param.dtype)
        self.optimizers().step()
        bad = first_non_finite({"x": self.global_params()})
        if bad is not None:
            raise self._diverged(f"server update {step}: the global model became non-finite ({bad})")
        self._log_round(plan, broadcast, uploads, [r for _, r in arrived], extra)

    def _run_version(self, events: EventQueue, version: int, group: list[InFlight], server_state) -> dict:
        """Train the buffered clients sent ``version``, in one executor call; their results by dispatch index."""
        data = self.datamodule
        info = RoundInfo(version, self.local.lr_at(version), data.num_clients, None, None)
        broadcast = self.algorithm.broadcast(events.versions[version], server_state, info)
        tasks = []
        for e in group:
            load_state = functools.partial(self.client_state, e.client, broadcast["x"])
            load_messages = functools.partial(self.message_state, e.client) if self.messages.client_stages else None
            seed = derive_seed(data.seed, e.index, e.client, DISPATCH_STREAM)
            tasks.append(ClientTask(e.client, seed, e.steps, broadcast, load_state, False, load_messages))
        index_of = {e.client: e.index for e in group}
        return {index_of[r.client_id]: r for r in self.executor.run(tasks, info, self._runtime())}

"""The compiled round (docs/performance.md, "The compiled round"): one ``torch.compile``d program a round that runs
the stacked clients' K local steps, their finish, the aggregate and the server optimizer's step together.

Batched compiled execution otherwise compiles the clients' local steps only, and the round's Python around them
(the finish, the sums, the pseudo-gradient, the server step) runs op by op. Here that Python is traced once into the
round's program, and the driver commits what the program returns (the new global model, server state, optimizer
state and client states) only after the round's stages have admitted the uploads (finite, the loss checks): a
round ends as the eager round would, to float tolerance. The server optimizer's step is its pure form
(``fl_lightning.optim.functional``), written back into torch.optim's state.

A round runs here only where every part of it allows: one process, clients of equal local work stacked without
padding (``local.steps`` steps of ``local.batch_size`` rows each), an elementwise rule without its own local loss,
personal tensors or record-level DP, an aggregate that is a sum over clients, a server optimizer with a pure form
(SGD with or without momentum, Adam, Yogi), and stages that declare ``fusable``. Any other round runs as before,
the reason logged once.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, RoundInfo, declares_capability
from fl_lightning.core.local_loss import defines_local_loss
from fl_lightning.core.objective import StepRecord
from fl_lightning.core.params import TensorDict
from fl_lightning.core.round_results import RoundResults, StackedPayloads
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import ClientTask, SummedRound, shares_broadcast, task_columns
from fl_lightning.executors.base import ClientRuntime, check_loss, finish_client, seed_client, to_device
from fl_lightning.core.errors import one_line
from fl_lightning.executors.compiled import (CompileError, _declared_cause, _fresh, _inductor_settings, _is_untraceable, _no_full_grad, log_fallback,
                                             stacked_local_steps, tensor_lr)  # fmt: skip
from fl_lightning.optim.functional import FunctionalStep, State

log = logging.getLogger(__name__)


@dataclass
class ServerInputs:
    """What the round's program needs of the server: the global model x, the server state, the aggregation weights
    of the reporting clients (by id) and the server optimizer's pure step."""

    x: TensorDict
    server_state: NestedState
    weights: Any
    step: FunctionalStep


@dataclass
class CompiledRound:
    """A round's program outputs: the clients' results (columns, no uploads: ``summed`` holds their sums' facts), and
    the server's new model, state and optimizer state, to commit once the stages admit the round."""

    summed: SummedRound
    x: list[Tensor]
    server_state: NestedState
    optimizer_state: State
    step: FunctionalStep

    def commit(self) -> None:
        self.step.write(self.x, self.optimizer_state)


def _round_fn(algorithm, objective, weight_decay, names, step_fn, x, server_state, optimizer_state, client_state, ids, info, broadcast,
              batches, weights):  # fmt: skip
    """The traced round: local steps, stacked finish, upload sums, pseudo-gradient, server step; and the facts the
    round's stages and metrics read (each client's uploads finite, the deltas' float64 sum and squared norms)."""
    size, num_steps = ids.shape[0], len(batches)
    params = {k: v.unsqueeze(0).expand(size, *v.shape).contiguous() for k, v in broadcast["x"].items()}
    params, local, evaluations = stacked_local_steps(algorithm, objective, weight_decay, params, client_state, ids, info, broadcast, {}, batches)
    ctx = ClientContext(ids, broadcast, client_state, info, num_steps, full_grad=_no_full_grad, data_pass=_no_data_pass, personal={})
    ctx.step = num_steps - 1
    uploads, new_states = finish_client(algorithm, params, local, ctx)
    sums = algorithm.upload_sum(x, StackedPayloads(uploads, size), weights, info)
    pseudo_grad, new_server_state = algorithm.aggregate_sum(x, sums, server_state, info, [num_steps] * size)
    new_x, new_optimizer_state = step_fn([x[n] for n in names], [pseudo_grad[n].to(x[n].dtype) for n in names], optimizer_state)
    flags = [torch.isfinite(t).reshape(size, -1).all(1) for td in uploads.values() for t in td.values()]
    finite = torch.stack(flags).all(0) if flags else torch.ones(size, dtype=torch.bool)
    deltas = uploads.get("delta", {})
    delta_sum = {k: v.double().sum(0) for k, v in deltas.items()}
    delta_sq = sum(v.double().square().reshape(size, -1).sum(1) for v in deltas.values())
    return new_x, new_server_state, new_optimizer_state, new_states, evaluations, finite, delta_sum, delta_sq, uploads


def _no_data_pass(params: TensorDict) -> Any:
    raise ValueError("a client_finish that reads ctx.data_pass (the client's whole set) runs client by client, not in the compiled round")


class RoundProgram:
    """The compiled round programs of one executor: one per (clients, steps, batch shapes), at most ``max_variants``."""

    def __init__(self, backend: str = "inductor", max_variants: int = 4) -> None:
        self.backend, self.max_variants = backend, max_variants
        self.program = torch.compile(_fresh(_round_fn), fullgraph=True, dynamic=False, backend=backend)
        self.variants: set[tuple] = set()
        self.compile_seconds = 0.0
        self.rounds = 0  # rounds run as one program
        self.fallbacks: Counter[str] = Counter()  # rounds run step by step instead, by reason
        self.disabled: str | None = None
        self._config = torch._dynamo.config.patch(recompile_limit=max_variants, fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False)
        self._inductor = None

    def unsupported(self, tasks: Sequence[ClientTask], runtime: ClientRuntime, server: ServerInputs | str, idealised: bool) -> str | None:
        """Why this round cannot run as one program (None: it can)."""
        algorithm, name = runtime.algorithm, type(runtime.algorithm).__name__
        reasons = (
            (self.disabled is not None, self.disabled),
            (isinstance(server, str), server),
            (runtime.personal_names, "the model has personal tensors"),
            (runtime.record_privacy is not None, "record-level DP-SGD draws each client's own records"),
            (not declares_capability(algorithm, "elementwise"), f"{name}'s rule is not declared elementwise"),
            (defines_local_loss(algorithm), f"{name} has its own local loss"),
            (not shares_broadcast(tasks), "clients receive their own broadcasts"),
            (not idealised, "the round's clients run unequal local work (steps or batch rows)"),
        )  # fmt: skip
        return next((why for bad, why in reasons if bad), None)

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime, server: ServerInputs, load_states: Any,
            means: Any) -> CompiledRound | None:  # fmt: skip
        """The round as one program, or None (``disabled`` says why). ``load_states(tasks)``: the clients' states as the
        batched executor loads them; ``means(record, None, size)``: each client's mean loss, accuracy and loss terms."""
        clients, seeds, steps = task_columns(tasks)
        local, device = runtime.local, runtime.device
        batches = [to_device(b, device) for b in runtime.data.stacked_client_batches(clients, seeds, local.batch_size, local.steps)]
        _, stacked_states, _ = load_states(tasks)
        seed_client(seeds[0], device)
        ids = torch.tensor(clients)
        weights = server.weights(clients).to(device)
        names = list(server.x)
        key = (len(clients), local.steps, tuple(t.shape[1:] for t in _leaves(batches[0])))
        if key not in self.variants and len(self.variants) >= self.max_variants:
            self.disabled = f"more than {self.max_variants} round programs (shapes) would be needed"
            return None
        started = time.perf_counter()
        if self._inductor is None:
            self._inductor = _inductor_settings(self.backend)
        try:
            with self._config, self._inductor:
                out = self.program(runtime.algorithm, runtime.objective, local.weight_decay, names, server.step.step, server.x, server.server_state,
                                   server.step.state(), stacked_states, ids, tensor_lr(info), tasks.broadcast, batches, weights)  # fmt: skip
        except Exception as error:
            declared = _declared_cause(error)
            if declared is None and not _is_untraceable(error):  # the compiler itself failed: it would fail again
                raise CompileError(
                    f"compiling the round failed: {one_line(error)}; run with --model.execution.init_args.compile_round false"
                ) from error
            self.disabled = f"the round does not compile: {one_line(declared or error)}"  # it runs step by step from now on
            return None
        if key not in self.variants:
            self.variants.add(key)
            self.compile_seconds += time.perf_counter() - started
        self.rounds += 1
        new_x, server_state, optimizer_state, new_states, evaluations, finite, delta_sum, delta_sq, uploads = out
        record = StepRecord()
        for value, outputs, target, terms in evaluations:
            record.add(value, outputs, target, terms or None)
        losses, accuracies, terms = means(record, None, len(clients))
        for client, loss in zip(clients, losses if record.losses else []):
            check_loss(info.round, client, loss)
        results = RoundResults.stacked(clients, steps, losses, accuracies, {}, new_states, terms)
        bad = [c for c, ok in zip(clients, finite.tolist()) if not ok]
        upload_bytes = StackedPayloads(uploads, len(clients)).row_bytes()
        summed = SummedRound(results, {}, [upload_bytes] * len(clients), delta_sum, float(delta_sq.sum()), bad)
        return CompiledRound(summed, new_x, server_state, optimizer_state, server.step)

    def fallback(self, reason: str) -> None:
        log_fallback(self.fallbacks, reason, log, to="the round step by step")


def _leaves(batch: Any) -> list[Tensor]:
    return [t for t in (batch if isinstance(batch, list | tuple) else [batch]) if isinstance(t, Tensor)]

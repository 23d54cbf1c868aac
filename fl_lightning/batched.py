"""Batched execution: the round's clients train together under ``torch.func.vmap``.

Parameters, local optimizer state and client state are stacked on a leading
client dimension; each step gathers an ``[S, B, ...]`` batch with one indexing
op and evaluates every client's rule at once (``grad_and_value`` over the one
model, ``vmap`` over clients). Minibatch indices and seeds are those of
sequential execution, so results agree to float tolerance for rules built from
tensor ops (summation order differs, e.g. convolutions become grouped).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap
from torch.utils.data import TensorDataset

from fl_lightning import params as P
from fl_lightning.algorithms.base import ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.execution import SequentialExecution, forward_loss, seed_client, to_device
from fl_lightning.params import TensorDict
from fl_lightning.participation import RoundPlan

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule

log = logging.getLogger(__name__)


def _stack(states: list[Any]) -> Any:
    """Stack a list of equally-shaped nested tensor dicts along a new leading dimension."""
    first = states[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in states]) for k in first}
    return torch.stack(states)


def _index(state: Any, i: int) -> Any:
    if isinstance(state, dict):
        return {k: _index(v, i) for k, v in state.items()}
    return state[i]


def _no_full_grad(params: TensorDict) -> TensorDict:
    raise NotImplementedError("full local gradients need sequential execution (clients differ in size)")


class BatchedExecution:
    """Run all active clients' local steps together; fall back to sequential with a logged reason."""

    def __init__(self) -> None:
        self.sequential = SequentialExecution()
        self._reported: set[str] = set()

    def run_warmup(self, module: FederatedModule, broadcast: Payload, info: RoundInfo):
        return self.sequential.run_warmup(module, broadcast, info)

    def unsupported_reason(self, module: FederatedModule, plan: RoundPlan) -> str | None:
        local, data = module.local, module.datamodule
        if local.steps is None:
            return "local.epochs gives clients different numbers of steps; use local.steps"
        if plan.max_steps is not None and bool((plan.max_steps < local.steps).any()):
            return "stragglers run fewer local steps than the others"
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in module.model.modules()):
            return "BatchNorm running statistics are module state that vmap cannot update per client"
        if module.personal_names:
            return "personal tensors are trained client by client"
        if not getattr(module.algorithm, "batchable", True):
            return f"{type(module.algorithm).__name__} declares batchable = False"
        if not isinstance(data.source.train, TensorDataset):
            return "the training set is not in-memory tensors (TensorDataset)"
        if local.batch_size is None or any(int(data.client_sizes[c]) < local.batch_size for c in plan.clients):
            return "a client holds fewer samples than local.batch_size, so batches cannot be stacked"
        return None

    def _fallback(self, reason: str, module, plan, broadcast, info) -> list[ClientResult]:
        if reason not in self._reported:
            self._reported.add(reason)
            log.warning("batched execution falls back to sequential: %s", reason)
        return self.sequential.run(module, plan, broadcast, info)

    def run(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        if len(plan.clients) == 0:
            return []
        reason = self.unsupported_reason(module, plan)
        if reason is None:
            try:
                return self._run_batched(module, plan, broadcast, info)
            except NotImplementedError as error:
                reason = str(error)
            except ValueError:
                raise
            except Exception as error:  # a failing client: rerun one by one to isolate it
                reason = f"a client raised ({error!r}); the round is rerun client by client"
        return self._fallback(reason, module, plan, broadcast, info)

    def _run_batched(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        algorithm, data, local, model, swap = module.algorithm, module.datamodule, module.local, module.model, module.parameter_swap
        device = module.device
        clients = [int(c) for c in plan.clients]
        num_clients, num_steps, x = len(clients), local.steps, broadcast["x"]
        client_state = _stack([module.client_state(c, x) for c in clients])
        streams = [
            data.client_batch_indices(c, int(s), local.batch_size, local.steps, None) for c, s in zip(clients, plan.seeds)
        ]
        tensors = data.source.train.tensors
        augments = getattr(data, "augments_batches", True)
        generators = [data.augment_generator(int(s)) for s in plan.seeds]
        # Different randomness per client (dropout); the CPU generator seeded from the round's first client.
        seed_client(int(plan.seeds[0]), device)

        def context(state: Any, step: int, grad=None) -> ClientContext:
            return ClientContext(-1, broadcast, state, info, num_steps, grad=grad, full_grad=_no_full_grad, step=step)

        def loss_at(params: TensorDict, batch: Any) -> Tensor:
            with swap(params):
                return forward_loss(model, batch)[0]

        def init(params: TensorDict, state: Any) -> Any:
            return algorithm.client_init(params, context(state, 0))

        def step_fn(step: int):
            def one_client(params: TensorDict, local_state: Any, state: Any, *batch: Tensor):
                first_loss: list[Tensor] = []

                def grad(p: TensorDict) -> tuple[Tensor, TensorDict]:
                    g, loss = grad_and_value(loss_at)(p, batch)
                    if local.weight_decay:
                        g = P.add(g, p, local.weight_decay)
                    if not first_loss:
                        first_loss.append(loss)
                    return loss, g

                new_params, new_local = algorithm.client_step(params, local_state, context(state, step, grad))
                return new_params, new_local, first_loss[0] if first_loss else torch.zeros(())

            return vmap(one_client, randomness="different")

        def finish(params: TensorDict, local_state: Any, state: Any) -> tuple[Payload, Any]:
            return algorithm.client_finish(params, local_state, context(state, num_steps))

        params = {k: v.unsqueeze(0).expand(num_clients, *v.shape).clone() for k, v in x.items()}
        local_state = vmap(init, randomness="different")(params, client_state)
        losses = []
        for step in range(num_steps):
            index = torch.stack([next(s) for s in streams])  # [S, B]
            if augments:  # per-client transforms, then stacked
                views = [data.augment(tuple(t[i] for t in tensors), c, g) for i, c, g in zip(index, clients, generators)]
                batch = to_device(tuple(torch.stack(parts) for parts in zip(*views)), device)
            else:  # one gather for all clients
                batch = to_device(tuple(t[index] for t in tensors), device)
            params, local_state, loss = step_fn(step)(params, local_state, client_state, *batch)
            losses.append(loss)
        uploads, new_states = vmap(finish, randomness="different")(params, local_state, client_state)
        mean_losses = torch.stack(losses).mean(0).tolist()
        return [
            ClientResult(c, _index(uploads, i), _index(new_states, i), num_steps, mean_losses[i])
            for i, c in enumerate(clients)
        ]

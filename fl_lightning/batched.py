"""Batched execution: the round's clients train together, stacked on a leading dimension.

Parameters, local optimizer state and client state are stacked on a leading
client dimension and each step gathers one ``[S, B, ...]`` batch. The per-client
losses come from one ``torch.func.vmap`` of the model's forward; since clients are
independent, the gradient of their *sum* with respect to the stacked parameters
is every client's own gradient, from one ordinary backward pass.

Algorithms whose client rule is elementwise (``Algorithm.elementwise``) then apply
that rule once to the stacked tensors; others run their rule under ``vmap``
(``grad_and_value`` inside), which is general but costs far more per step.
Minibatch indices and seeds are those of sequential execution, so results agree
to float tolerance (summation order differs, e.g. convolutions become grouped).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad_and_value, vmap
from torch.utils.data import TensorDataset

from fl_lightning import params as P
from fl_lightning.algorithms.base import ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.execution import SequentialExecution, forward_loss, loss_grads, seed_client, to_device
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


def _unstack(state: Any, num_clients: int) -> list[Any]:
    """The inverse of ``_stack``: one view per client (``unbind``: one op per tensor, not per client)."""
    if isinstance(state, dict):
        per_key = {k: _unstack(v, num_clients) for k, v in state.items()}
        return [{k: parts[i] for k, parts in per_key.items()} for i in range(num_clients)]
    return list(state.unbind(0))


def _no_full_grad(params: TensorDict) -> TensorDict:
    raise NotImplementedError("full local gradients need sequential execution (clients differ in size)")


class _NotPlainOutputs(Exception):
    """The model's forward returns more than logits (e.g. a penalty): use its own loss under vmap."""


class BatchedExecution:
    """Run all active clients' local steps together; fall back to sequential with a logged reason."""

    def __init__(self) -> None:
        self.sequential = SequentialExecution()
        self._reported: set[str] = set()
        self._plain_outputs = True  # logits + cross-entropy: the loss is computed outside vmap

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

    # ---- the round's minibatches ------------------------------------------------------------
    @staticmethod
    def _batches(module: FederatedModule, plan: RoundPlan) -> Any:
        """Step k's stacked ``[S, B, ...]`` batch, for k = 0 .. K-1 (the indices of sequential execution)."""
        data, local, device = module.datamodule, module.local, module.device
        clients, seeds = plan.clients.tolist(), plan.seeds.tolist()
        index = torch.stack(
            [data.client_batch_index_matrix(c, s, local.batch_size, local.steps) for c, s in zip(clients, seeds)]
        )  # [S, K, B]
        tensors = data.source.train.tensors
        if getattr(data, "augments_batches", True):  # per-client transforms, then stacked
            generators = [data.augment_generator(s) for s in seeds]
            for step in range(local.steps):
                views = [data.augment(tuple(t[i] for t in tensors), c, g) for i, c, g in zip(index[:, step], clients, generators)]
                yield to_device(tuple(torch.stack(parts) for parts in zip(*views)), device)
        else:
            for step in range(local.steps):  # one gather per tensor for all clients
                yield to_device(tuple(t[index[:, step]] for t in tensors), device)

    # ---- per-client losses and gradients of stacked parameters ----------------------------------
    def _client_losses(self, module: FederatedModule, params: TensorDict, batch: Any) -> Tensor:
        """``[S]`` minibatch losses, client i's at ``params[.][i]`` on ``batch[.][i]``."""
        model, swap = module.model, module.parameter_swap
        if self._plain_outputs and not hasattr(model, "loss"):
            *inputs, target = batch

            def outputs_at(p: TensorDict, *x: Tensor) -> Tensor:
                with swap(p):
                    out = model(*x)
                if not isinstance(out, Tensor):
                    raise _NotPlainOutputs
                return out

            try:
                out = vmap(outputs_at, randomness="different")(params, *inputs)
            except _NotPlainOutputs:
                self._plain_outputs = False
            else:  # cross-entropy outside vmap: one kernel for all clients instead of a vmapped decomposition
                if out.dim() == 3 and target.dim() == 2 and not target.is_floating_point():
                    per_sample = F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="none")
                    return per_sample.view(target.shape).mean(1)
                return vmap(F.cross_entropy)(out, target)

        def loss_at(p: TensorDict, *b: Tensor) -> Tensor:
            with swap(p):
                return forward_loss(model, b)[0]

        return vmap(loss_at, randomness="different")(params, *batch)

    def _stacked_grad(self, module: FederatedModule, batch: Any, losses: list[Tensor]):
        """``ctx.grad`` over stacked parameters: ``([S] losses, {name: [S, ...] gradients})``."""
        weight_decay = module.local.weight_decay
        recorded = False

        def grad(params: TensorDict) -> tuple[Tensor, TensorDict]:
            nonlocal recorded
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            client_losses = self._client_losses(module, leaves, batch)
            grads = dict(zip(leaves, loss_grads(client_losses.sum(), list(leaves.values()))))
            if weight_decay:
                grads = P.add(grads, params, weight_decay)
            if not recorded:  # the step's first evaluation is its reported loss
                losses.append(client_losses.detach())
                recorded = True
            return client_losses.detach(), grads

        return grad

    # ---- the round ---------------------------------------------------------------------------
    def _run_batched(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        algorithm, local, x = module.algorithm, module.local, broadcast["x"]
        clients = plan.clients.tolist()
        num_clients, num_steps = len(clients), local.steps
        client_state = _stack([module.client_state(c, x) for c in clients])
        # Different randomness per client (dropout); the CPU generator seeded from the round's first client.
        seed_client(int(plan.seeds[0]), module.device)
        params = {k: v.unsqueeze(0).expand(num_clients, *v.shape) for k, v in x.items()}
        losses: list[Tensor] = []
        rule = self._elementwise_rule if getattr(algorithm, "elementwise", False) else self._vmapped_rule
        uploads, new_states = rule(module, params, client_state, broadcast, info, self._batches(module, plan), losses)
        mean_losses = torch.stack(losses).mean(0).tolist() if losses else [float("nan")] * num_clients
        uploads, new_states = _unstack(uploads, num_clients), _unstack(new_states, num_clients)
        return [
            ClientResult(c, uploads[i], new_states[i], num_steps, mean_losses[i]) for i, c in enumerate(clients)
        ]

    def _elementwise_rule(self, module, params, client_state, broadcast, info, batches, losses):
        """The rule applied once to all clients' stacked tensors (no vmap around it)."""
        algorithm, num_steps = module.algorithm, module.local.steps
        ctx = ClientContext(-1, broadcast, client_state, info, num_steps, full_grad=_no_full_grad)
        local_state = algorithm.client_init(params, ctx)
        for step, batch in enumerate(batches):
            ctx.step = step
            ctx.grad = self._stacked_grad(module, batch, losses)
            params, local_state = algorithm.client_step(params, local_state, ctx)
        return algorithm.client_finish(params, local_state, ctx)

    def _vmapped_rule(self, module, params, client_state, broadcast, info, batches, losses):
        """A rule with reductions (e.g. FedSAM's gradient norm): run per client under vmap."""
        algorithm, model, swap, local = module.algorithm, module.model, module.parameter_swap, module.local
        num_steps = local.steps

        def context(state: Any, step: int, grad=None) -> ClientContext:
            return ClientContext(-1, broadcast, state, info, num_steps, grad=grad, full_grad=_no_full_grad, step=step)

        def loss_at(p: TensorDict, batch: Any) -> Tensor:
            with swap(p):
                return forward_loss(model, batch)[0]

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

        def init(p: TensorDict, state: Any) -> Any:
            return algorithm.client_init(p, context(state, 0))

        def finish(p: TensorDict, local_state: Any, state: Any) -> tuple[Payload, Any]:
            return algorithm.client_finish(p, local_state, context(state, num_steps))

        local_state = vmap(init, randomness="different")(params, client_state)
        for step, batch in enumerate(batches):
            params, local_state, loss = step_fn(step)(params, local_state, client_state, *batch)
            losses.append(loss)
        return vmap(finish, randomness="different")(params, local_state, client_state)

"""How the active clients' local training is run.

Sequential execution trains the round's clients one after another on the one
model the module owns: each client starts from a copy of the broadcast
parameters, so no per-client model copies exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning import params as P
from fl_lightning.algorithms.base import ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.params import TensorDict
from fl_lightning.participation import RoundPlan, derive_seed
from fl_lightning.state import NestedState

_WARMUP_STREAM = 0x3A4D

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


def forward_loss(model: nn.Module, params: TensorDict | None, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Loss, outputs and targets of ``model`` on a batch, with ``params`` substituted if given.

    A batch is ``(inputs..., target)`` or a dict with ``labels`` (Hugging Face style).
    The loss is ``model.loss(outputs, target)`` if the model defines it, else cross-entropy,
    plus ``outputs.penalty`` if the model's output carries one (a regularizer of the
    parameters, computed in ``forward`` where ``params`` are substituted).
    """
    call = model if params is None else (lambda *a, **k: functional_call(model, params, a, k))
    if isinstance(batch, dict):
        target = batch["labels"]
        raw = call(**{k: v for k, v in batch.items() if k != "labels"})
    else:
        *inputs, target = batch
        raw = call(*inputs)
    out = getattr(raw, "logits", raw)
    loss = model.loss(out, target) if hasattr(model, "loss") else F.cross_entropy(out, target)
    penalty = getattr(raw, "penalty", None)
    if penalty is not None:
        loss = loss + penalty
    return loss, out, target


def make_grad_fn(
    model: nn.Module, batch: Any, weight_decay: float, losses: list[float] | None = None
) -> Callable[[TensorDict], tuple[Tensor, TensorDict]]:
    """Gradient of the minibatch loss plus ``weight_decay/2 ||w||^2`` at given parameters.

    The first evaluation's loss (without the decay term) is appended to ``losses``.
    """
    recorded = False

    def grad(params: TensorDict) -> tuple[Tensor, TensorDict]:
        nonlocal recorded
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss, _, _ = forward_loss(model, leaves, batch)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        if weight_decay:
            grads = P.add(grads, params, weight_decay)
        if losses is not None and not recorded:
            losses.append(float(loss.detach()))
            recorded = True
        return loss.detach(), grads

    return grad


class SequentialExecution:
    """Train the active clients one after another."""

    def run(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        return [
            self.run_client(module, int(cid), int(seed), broadcast, info) for cid, seed in zip(plan.clients, plan.seeds)
        ]

    @staticmethod
    def run_client(module: FederatedModule, client_id: int, seed: int, broadcast: Payload, info: RoundInfo) -> ClientResult:
        algorithm, data, local, model = module.algorithm, module.datamodule, module.local, module.model
        device = module.device
        torch.manual_seed(seed)  # model-internal randomness (dropout) is addressable by (seed, round, client)
        client_state = module.client_state(client_id, broadcast["x"])
        personal = module.client_personal(client_id)
        num_steps = data.num_local_steps(client_id, local.batch_size, local.steps, local.epochs)

        def full_grad(params: TensorDict) -> TensorDict:
            batch = move_data_to_device(data.client_full_batch(client_id), device)
            return make_grad_fn(model, batch, local.weight_decay)(params)[1]

        ctx = ClientContext(client_id, broadcast, client_state, info, num_steps, full_grad=full_grad, personal=personal)
        params = P.detach_clone(broadcast["x"])
        params.update(P.detach_clone(personal))  # personal tensors train beside the shared ones, never leave
        local_state = algorithm.client_init(params, ctx)
        losses: list[float] = []
        batches = data.client_batches(client_id, seed, local.batch_size, local.steps, local.epochs)
        for step, batch in enumerate(batches):
            ctx.step = step
            ctx.grad = make_grad_fn(model, move_data_to_device(batch, device), local.weight_decay, losses)
            params, local_state = algorithm.client_step(params, local_state, ctx)
        shared = {k: params[k] for k in broadcast["x"]} if personal else params
        upload, new_state = algorithm.client_finish(shared, local_state, ctx)
        new_personal = algorithm.personal_finish(params, local_state, ctx) if personal else {}
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        return ClientResult(client_id, upload, new_state, num_steps, mean_loss, new_personal)

    def run_warmup(self, module: FederatedModule, broadcast: Payload, info: RoundInfo) -> list[tuple[Payload, NestedState]]:
        """Every client's ``client_warmup`` (upload, state), in client-id order."""
        return [self.warmup_client(module, cid, broadcast, info) for cid in range(info.num_clients)]

    @staticmethod
    def warmup_client(
        module: FederatedModule, client_id: int, broadcast: Payload, info: RoundInfo
    ) -> tuple[Payload, NestedState]:
        algorithm, data, local, model = module.algorithm, module.datamodule, module.local, module.model
        seed = derive_seed(data.seed, client_id, _WARMUP_STREAM)  # fresh samples xi^{-1}, addressable
        torch.manual_seed(seed)
        num_steps = data.num_local_steps(client_id, local.batch_size, local.steps, local.epochs)

        def mean_grad(params: TensorDict) -> TensorDict:
            batches = data.client_batches(client_id, seed, local.batch_size, local.steps, local.epochs)
            grads = [make_grad_fn(model, move_data_to_device(b, module.device), local.weight_decay)(params)[1] for b in batches]
            return P.mean(grads)

        personal = module.client_personal(client_id)
        client_state = module.client_state(client_id, broadcast["x"])
        ctx = ClientContext(client_id, broadcast, client_state, info, num_steps, personal=personal, mean_grad=mean_grad)
        params = {**P.detach_clone(broadcast["x"]), **P.detach_clone(personal)}
        return algorithm.client_warmup(params, ctx)

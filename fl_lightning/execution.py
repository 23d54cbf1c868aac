"""How the active clients' local training is run.

Sequential execution trains the round's clients one after another on the one
model the module owns: each client starts from a copy of the broadcast
parameters, so no per-client model copies exist.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn

from fl_lightning import params as P
from fl_lightning.algorithms.base import ClientContext, ClientResult, Payload, RoundInfo
from fl_lightning.faults import ClientError
from fl_lightning.params import TensorDict
from fl_lightning.participation import RoundPlan, derive_seed
from fl_lightning.state import NestedState

_WARMUP_STREAM = 0x3A4D

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


class ParameterSwap:
    """Evaluate one model with some of its parameters replaced by given tensors.

    Equivalent to ``torch.func.functional_call`` for parameters, without its
    per-call bookkeeping (the slot of every name is resolved once): the round
    loop swaps parameters thousands of times per second.
    """

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.slots = {}
        for name in names:
            owner, _, attr = name.rpartition(".")
            self.slots[name] = (model.get_submodule(owner) if owner else model, attr)

    def __call__(self, params: TensorDict) -> _Swapped:
        """A context manager (a plain class: ``contextlib``'s generator costs more than the swap)."""
        return _Swapped(self.slots, params)


class _Swapped:
    __slots__ = ("slots", "params", "saved")

    def __init__(self, slots: dict, params: TensorDict) -> None:
        self.slots, self.params, self.saved = slots, params, []

    def __enter__(self) -> None:
        for name, tensor in self.params.items():
            module, attr = self.slots[name]
            self.saved.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = tensor

    def __exit__(self, *exc: object) -> None:
        for module, attr, original in self.saved:
            module._parameters[attr] = original
        self.saved.clear()


def _custom_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``model.loss`` if the model defines one (checked without ``nn.Module.__getattr__``'s slow miss)."""
    if hasattr(type(model), "loss") or "loss" in model.__dict__ or "loss" in model._modules:
        return model.loss
    return None


def forward_loss(model: nn.Module, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Loss, outputs and targets of ``model`` on a batch.

    A batch is ``(inputs..., target)`` or a dict with ``labels`` (Hugging Face style).
    The loss is ``model.loss(outputs, target)`` if the model defines it, else cross-entropy,
    plus ``outputs.penalty`` if the model's output carries one (a regularizer of the
    parameters, computed in ``forward`` where ``params`` are substituted).
    """
    if isinstance(batch, dict):
        target = batch["labels"]
        raw = model(**{k: v for k, v in batch.items() if k != "labels"})
    else:
        *inputs, target = batch
        raw = model(*inputs)
    plain = type(raw) is Tensor
    out = raw if plain else getattr(raw, "logits", raw)
    loss_fn = _custom_loss(model)
    loss = loss_fn(out, target) if loss_fn is not None else F.cross_entropy(out, target)
    penalty = None if plain else getattr(raw, "penalty", None)
    if penalty is not None:
        loss = loss + penalty
    return loss, out, target


def forward_loss_at(model: nn.Module, params: TensorDict, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``forward_loss`` with ``params`` substituted for the model's parameters of those names."""
    with ParameterSwap(model, list(params))(params):
        return forward_loss(model, batch)


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


_UNIT_SEEDS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def loss_grads(loss: Tensor, leaves: list[Tensor]) -> tuple[Tensor, ...]:
    """``torch.autograd.grad(loss, leaves)``, minus its per-call Python checks.

    The autograd engine is called the way ``torch.autograd.grad`` calls it, with a cached
    unit seed: the wrapper's argument normalisation costs ~100 us per call, a quarter of a
    small model's whole step (benchmarks/run.py). Falls back to the public function if
    the engine entry point is missing.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or loss.dim() != 0:
        return torch.autograd.grad(loss, leaves)
    key = (loss.dtype, loss.device)
    seed = _UNIT_SEEDS.get(key)
    if seed is None:
        seed = _UNIT_SEEDS[key] = torch.ones((), dtype=loss.dtype, device=loss.device)
    return engine.run_backward((loss,), (seed,), False, False, tuple(leaves), False, False)


def make_grad_fn(
    model: nn.Module, swap: ParameterSwap, batch: Any, weight_decay: float, losses: list[float] | None = None
) -> Callable[[TensorDict], tuple[Tensor, TensorDict]]:
    """Gradient of the minibatch loss plus ``weight_decay/2 ||w||^2`` at given parameters.

    The first evaluation's loss (without the decay term) is appended to ``losses``.
    """
    recorded = False

    def grad(params: TensorDict) -> tuple[Tensor, TensorDict]:
        nonlocal recorded
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with swap(leaves):
            loss, _, _ = forward_loss(model, batch)
        grads = dict(zip(leaves, loss_grads(loss, list(leaves.values()))))
        if weight_decay:
            grads = P.add(grads, params, weight_decay)
        loss = loss.detach()
        if losses is not None and not recorded:
            losses.append(loss.item())
            recorded = True
        return loss, grads

    return grad


class _Setting(NamedTuple):
    """What every client of a round shares, looked up once per round."""

    algorithm: Any
    data: Any
    local: Any
    model: nn.Module
    device: torch.device
    swap: ParameterSwap

    @classmethod
    def of(cls, module: FederatedModule) -> _Setting:
        return cls(module.algorithm, module.datamodule, module.local, module.model, module.device, module.parameter_swap)


class SequentialExecution:
    """Train the active clients one after another."""

    def run(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        """Results of the clients that completed; a client that raises is left out (see ``ClientFaults``).

        A ``ValueError`` signals a bad setting, not a client fault: it always propagates.
        """
        results, setting = [], _Setting.of(module)
        for i, (cid, seed) in enumerate(zip(plan.clients.tolist(), plan.seeds.tolist())):
            budget = None if plan.max_steps is None else int(plan.max_steps[i])
            try:
                results.append(self.run_client(module, cid, seed, broadcast, info, budget, setting))
            except ValueError:
                raise
            except Exception as error:
                if module.faults.fail_fast:
                    raise ClientError(f"round {info.round}: client {cid} failed: {error!r}") from error
                log.warning("round %d: client %d failed and is left out of the aggregate: %r", info.round, cid, error)
        return results

    @staticmethod
    def run_client(
        module: FederatedModule,
        client_id: int,
        seed: int,
        broadcast: Payload,
        info: RoundInfo,
        max_steps: int | None = None,
        setting: _Setting | None = None,
    ) -> ClientResult:
        algorithm, data, local, model, device, swap = setting or _Setting.of(module)
        seed_client(seed, device)
        client_state = module.client_state(client_id, broadcast["x"])
        personal = module.client_personal(client_id)
        num_steps = data.num_local_steps(client_id, local.batch_size, local.steps, local.epochs)
        if max_steps is not None:  # a straggler stops early
            num_steps = min(num_steps, max_steps)

        def full_grad(params: TensorDict) -> TensorDict:
            batch = to_device(data.client_full_batch(client_id), device)
            return make_grad_fn(model, swap, batch, local.weight_decay)(params)[1]

        ctx = ClientContext(client_id, broadcast, client_state, info, num_steps, full_grad=full_grad, personal=personal)
        # Rules are pure functions, so x needs no copy; personal tensors train beside the shared ones, never leave.
        params = {**broadcast["x"], **personal}
        local_state = algorithm.client_init(params, ctx)
        losses: list[float] = []
        batches = data.client_batches(client_id, seed, local.batch_size, local.steps, local.epochs)
        for step, batch in zip(range(num_steps), batches):
            ctx.step = step
            ctx.grad = make_grad_fn(model, swap, to_device(batch, device), local.weight_decay, losses)
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
        seed_client(seed, module.device)
        num_steps = data.num_local_steps(client_id, local.batch_size, local.steps, local.epochs)

        def mean_grad(params: TensorDict) -> TensorDict:
            batches = data.client_batches(client_id, seed, local.batch_size, local.steps, local.epochs)
            swap, device = module.parameter_swap, module.device
            grads = [make_grad_fn(model, swap, to_device(b, device), local.weight_decay)(params)[1] for b in batches]
            return P.mean(grads)

        personal = module.client_personal(client_id)
        client_state = module.client_state(client_id, broadcast["x"])
        ctx = ClientContext(client_id, broadcast, client_state, info, num_steps, personal=personal, mean_grad=mean_grad)
        params = {**P.detach_clone(broadcast["x"]), **P.detach_clone(personal)}
        return algorithm.client_warmup(params, ctx)

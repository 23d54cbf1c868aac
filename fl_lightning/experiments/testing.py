"""Checks for your own algorithms: batched against sequential, and a hand-worked two-client round.

``check_batched(algorithm)`` trains the algorithm for a few rounds on a small built-in problem
(synthetic Gaussian classes, an MLP) once sequentially and once batched, and returns the largest
difference of the global parameters, the server state and the clients' stored states; above
``tolerance`` it raises ``BatchedMismatch`` naming the algorithm and what its class declares
(a wrongly declared ``elementwise = True`` shows here). ``one_round(algorithm, x, clients)`` runs
one round of the rule on given parameters with fixed per-client gradients (or gradient functions,
e.g. of a fixed batch) and returns the uploads, the client states, the pseudo-gradient, the server
state and the new global parameters, for tests against numbers worked out by hand.
Both are what the built-in algorithms' tests use (``tests/test_fednova_fedexp.py``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, declares_capability
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.executors.base import finish_client

__all__ = ["BatchedCheck", "BatchedMismatch", "RoundResult", "check_batched", "one_round"]

GradSource = Sequence[TensorDict] | tuple[Callable[[TensorDict], TensorDict], int]
"""One client's gradients: one dict per local step (K = their number), or ``(grad_fn, K)`` with
``grad_fn(params)`` the gradient at ``params`` (e.g. ``torch.func.grad(loss)`` on a fixed batch)."""


@dataclass
class RoundResult:
    """One round of ``one_round``: per client (in the given order) its upload and new state; the
    aggregate's pseudo-gradient and server state; ``x`` after the algorithm's server optimizer step."""

    uploads: list[Payload]
    client_states: list[NestedState]
    pseudo_grad: TensorDict
    server_state: NestedState
    x: TensorDict


def one_round(
    algorithm: Algorithm,
    x: TensorDict,
    clients: Sequence[GradSource],
    *,
    lr: float = 0.1,
    weights: Sequence[float] | None = None,
    client_states: Sequence[NestedState] | None = None,
    server_state: NestedState | None = None,
    num_clients: int | None = None,
    round: int = 0,
    personal: Sequence[TensorDict] | None = None,
    personal_lr: float | None = None,
    data_pass: Sequence[Callable[[TensorDict], Any]] | None = None,
) -> RoundResult:
    """Run one round of ``algorithm`` from global parameters ``x`` for the given clients.

    Args:
        clients: one ``GradSource`` per client (client ids 0, 1, ...); ``ctx.grad`` returns the
            client's next gradient (its loss as NaN for fixed gradients).
        lr: the local learning rate eta_l.
        weights: aggregation weights w_i (default 1/S each).
        client_states, server_state: the states to start from (default: the algorithm's initial ones).
        num_clients: N, the population size (default: the number of clients given).
        personal: each client's personal tensors v_i (trained beside x, never uploaded; their new values come
            back under ``PERSONAL`` in ``client_states``); a gradient source then covers x's and v_i's names.
        personal_lr: gamma_v (``ctx.personal_lr``; default ``lr``).
        data_pass: each client's ``ctx.data_pass`` (the model's outputs on its whole training set, e.g.
            ``lambda params: DataPass(features, logits, target, mask)`` for FedProto's prototypes).
    """
    x = P.detach_clone(x)
    n = len(clients)
    weights = torch.tensor([1.0 / n] * n if weights is None else list(weights), dtype=torch.float64)
    server_state = algorithm.server_state_init(x) if server_state is None else server_state
    info = RoundInfo(round, lr, num_clients or n, None, personal_lr)
    broadcast = algorithm.broadcast(x, server_state, info)
    uploads, states, steps = [], [], []
    for cid, source in enumerate(clients):
        grad_fn, num_steps = _grad_source(source)
        state = algorithm.client_state_init(x) if client_states is None else client_states[cid]
        own = P.detach_clone(personal[cid]) if personal is not None else {}
        ctx = ClientContext(cid, broadcast, state, info, num_steps, full_grad=grad_fn, personal=own,
                            data_pass=data_pass[cid] if data_pass is not None else None)  # fmt: skip
        params = {**P.detach_clone(broadcast["x"]), **own}
        local = algorithm.client_init(params, ctx)
        for step in range(num_steps):
            ctx.step = step
            ctx.grad = lambda p, step=step: (torch.tensor(math.nan), grad_fn(p, step))
            params, local = algorithm.client_step(params, local, ctx)
        upload, new_state = finish_client(algorithm, params, local, ctx)
        uploads.append(upload)
        states.append(new_state)
        steps.append(num_steps)
    pseudo_grad, new_server_state = algorithm.aggregate(x, uploads, weights, server_state, info, steps)
    return RoundResult(uploads, states, pseudo_grad, new_server_state, _server_step(algorithm, x, pseudo_grad))


def _grad_source(source: GradSource) -> tuple[Callable[..., TensorDict], int]:
    if isinstance(source, tuple) and len(source) == 2 and callable(source[0]):
        fn, k = source
        return (lambda p, step=0: fn(p)), int(k)
    fixed = list(source)
    if not fixed:
        raise ValueError("one_round: a client needs at least one gradient (one dict per local step)")
    return (lambda p, step=0: fixed[step]), len(fixed)


def _server_step(algorithm: Algorithm, x: TensorDict, pseudo_grad: TensorDict) -> TensorDict:
    """``x`` after one step of the algorithm's server optimizer on ``pseudo_grad``."""
    params = [nn.Parameter(v.clone()) for v in x.values()]
    optimizer = algorithm.server_optimizer(params)
    for p, k in zip(params, x):
        p.grad = pseudo_grad[k].to(p.dtype)
    optimizer.step()
    return {k: p.detach() for k, p in zip(x, params)}


class BatchedMismatch(AssertionError):
    """Batched execution of an algorithm gave other results than sequential execution."""


@dataclass
class BatchedCheck:
    """What ``check_batched`` compared: the largest absolute difference and where it was."""

    max_difference: float
    where: str
    rounds: int
    stacked_rule: str  # "elementwise" (once on the stacked tensors) or "vmap" (per client)


def check_batched(
    algorithm: Algorithm,
    *,
    rounds: int = 3,
    num_clients: int = 6,
    clients_per_round: int = 4,
    local: Any = None,
    model: Callable[[], nn.Module] | None = None,
    tolerance: float = 1e-5,
    seed: int = 0,
    personal: list[str] | None = None,
) -> BatchedCheck:
    """Train ``algorithm`` sequentially and batched on a small built-in problem; compare.

    Each run gets its own deep copy of ``algorithm``. The problem: 300 samples of 3 Gaussian
    classes in 8 dimensions, Dirichlet(0.5) over ``num_clients`` clients, ``clients_per_round``
    sampled uniformly, an MLP 8-16-3 (``model``: a function building another one), local
    training ``local`` (default ``LocalTraining(lr=0.1, steps=3, batch_size=8)``).

    Returns the largest absolute difference of the global parameters, the server state and the
    clients' stored states after ``rounds`` rounds. Raises ``BatchedMismatch`` above ``tolerance``
    (float32 runs agree to about 1e-7) and ``ValueError`` if the batched run fell back to sequential
    execution (nothing would be compared; the message says why). ``personal``: the model's personal tensors
    (``FederatedModule``'s ``personal`` patterns, e.g. ``["net.3.*"]`` for the MLP's head), compared in the
    clients' stored states.
    """
    from fl_lightning.core.config import LocalTraining
    from fl_lightning.executors import BatchedExecutor

    local = local or LocalTraining(lr=0.1, steps=3, batch_size=8)
    runs = {}
    for execution in ("sequential", "batched"):
        executor = BatchedExecutor() if execution == "batched" else "sequential"
        runs[execution] = _fit_small(copy.deepcopy(algorithm), local, executor, rounds, num_clients, clients_per_round, model, seed, personal)
    fallbacks = runs["batched"].executor.fallbacks
    if fallbacks:
        raise ValueError(f"check_batched: batched execution fell back to sequential ({'; '.join(fallbacks)}): nothing was compared")
    difference, where = _largest_difference(_final_state(runs["sequential"]), _final_state(runs["batched"]))
    name = type(algorithm).__name__
    rule = "elementwise" if declares_capability(algorithm, "elementwise") else "vmap"
    if not difference <= tolerance:
        hint = (
            f"{name} declares elementwise = True, so batched execution applies its rule once to all clients' stacked "
            "tensors: a norm, sum or other reduction in client_init/client_step/client_finish then mixes the clients; "
            "remove the declaration (the rule then runs per client under vmap) or make the rule elementwise"
            if rule == "elementwise"
            else f"{name}'s rule runs per client under vmap; check it for state kept outside its return values"
        )
        raise BatchedMismatch(
            f"{name}: batched execution differs from sequential by {difference:.3g} at {where} after {rounds} rounds "
            f"(tolerance {tolerance:g}); {hint}"
        )
    return BatchedCheck(difference, where, rounds, rule)


def _fit_small(algorithm, local, execution, rounds, num_clients, clients_per_round, model, seed, personal=None):
    import lightning as L

    from fl_lightning.datamodules import Dirichlet, FederatedDataModule
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.core.participation import UniformSampling
    from fl_lightning.run.terminal import quiet_lightning
    from fl_lightning.models import MLP

    quiet_lightning()
    torch.manual_seed(seed)
    net = model() if model is not None else MLP(in_features=8, num_classes=3, hidden=[16])
    data = FederatedDataModule(
        dataset="synthetic",
        dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1},
        num_clients=num_clients,
        partition=Dirichlet(0.5, min_size=8),
        participation=UniformSampling(clients_per_round),
        seed=seed,
    )
    module = FederatedModule(net, algorithm, local, personal=personal, execution=execution)
    trainer = L.Trainer(
        max_steps=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return module


def _final_state(module) -> dict[str, Tensor]:
    out = {f"x/{k}": v.detach() for k, v in module.global_params().items()}
    out.update({f"server_state/{n}/{k}": v for n, td in module.server_state.items() for k, v in td.items()})
    out.update({f"client_state/{k}": v for k, v in module.store.state_dict().items()})
    return out


def _largest_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[float, str]:
    if a.keys() != b.keys():
        missing = sorted(a.keys() ^ b.keys())
        return math.inf, f"{missing[0]} (present in one run only)"
    worst, where = 0.0, "nowhere"
    for k in a:
        d = float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
        if not d <= worst:
            worst, where = d, k
    return worst, where

"""The realistic workloads of ``benchmarks/run.py`` (``mlp_realistic``, ``cnn_realistic``, ``lora_realistic``): their round
schedule, their bare PyTorch loop and how much of a batched run ran stacked.

A realistic round is what researchers run: Dirichlet(0.1) label skew (client sizes from 2 to a few
hundred samples, many clients smaller than a batch), ``local.epochs`` passes over each client's data in
batches of 32 (the last batch of a pass smaller, so K_i = epochs * ceil(n_i / 32) differs per client),
and 20 % stragglers (``ClientFaults(straggler=0.2)``: a straggler completes a uniform fraction in
[0.1, 1) of its K_i steps).

The bare loop does exactly the framework's work: the same round plans (``RoundPlans`` of the same
datamodule), the same per-client budgets (``num_local_steps`` cut by the same fault draw) and the same
minibatch indices (``client_batch_indices``), so ``client_steps`` counts one number for both and
``ratio_vs_bare`` compares equal work.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientWork:
    """One client's part of a round: who, its round seed, its steps after the fault draw, its weight."""

    client: int
    seed: int
    steps: int
    weight: float


def faults(spec: dict):
    """The workload's simulated faults (stragglers only: no client drops out)."""
    from fl_lightning.reliability.faults import ClientFaults

    return ClientFaults(straggler=spec["straggler"])


def local_training(spec: dict, lr: float):
    """``local.epochs`` passes of ``batch`` (``local.steps`` unset)."""
    from fl_lightning import LocalTraining

    return LocalTraining(lr=lr, steps=None, epochs=spec["epochs"], batch_size=spec["batch"])


def schedule(data, spec: dict, rounds: int) -> list[list[ClientWork]]:
    """Rounds 0..``rounds - 1`` as the framework runs them: its round plans and each client's budget
    (``FederatedModule._tasks``: ``num_local_steps``, then the fault draw from the client's round seed)."""
    from datamodules import RoundPlans

    drawn = faults(spec)
    plans = itertools.islice(iter(RoundPlans(data)), rounds)
    out = []
    for plan in plans:
        work = []
        for client, seed, weight in zip(plan.clients.tolist(), plan.seeds.tolist(), plan.weights.tolist()):
            steps = data.num_local_steps(client, spec["batch"], None, spec["epochs"])
            dropped, budget = drawn.draw(seed, steps)
            if not dropped:
                work.append(ClientWork(client, seed, budget, weight))
        out.append(work)
    return out


def client_steps(rounds: list[list[ClientWork]]) -> int:
    """The local steps of the timed rounds (all but the first, a warm-up)."""
    return sum(w.steps for work in rounds[1:] for w in work)


def bare_loop(model, data, spec: dict, rounds: int, lr: float, device, sync: Callable[[], None]) -> float:
    """Hand-written sequential FedAvg over the schedule: copy x in, the client's budget of SGD steps over
    its epoch batches, accumulate weighted deltas, add their weighted mean. Seconds of rounds 2..``rounds``."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    train = data.source.train
    if isinstance(train, TensorDataset):
        tensors = tuple(t.to(device) for t in train.tensors)

        def loss_of(idx):
            return F.cross_entropy(model(tensors[0][idx]), tensors[1][idx])
    else:  # text: the client's batch right-padded to its longest sequence (TokenSequences.gather)
        train = train.to(device)

        def loss_of(idx):
            batch = train.gather(idx.cpu())
            out = model(**{k: v for k, v in batch.items() if k != "labels"})
            return F.cross_entropy(getattr(out, "logits", out), batch["labels"])

    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    plan = schedule(data, spec, rounds)
    start = None
    for round_idx, work in enumerate(plan):
        if round_idx == 1:
            start = time.perf_counter()
        total = [torch.zeros_like(g) for g in global_params]
        weights = 0.0
        for w in work:
            with torch.no_grad():
                for p, g in zip(params, global_params):
                    p.copy_(g)
            batches = data.client_batch_indices(w.client, w.seed, spec["batch"], epochs=spec["epochs"])
            for idx in itertools.islice(batches, w.steps):
                grads = torch.autograd.grad(loss_of(idx.to(device)), params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(g, alpha=lr)
            with torch.no_grad():
                for t, p, g in zip(total, params, global_params):
                    t.add_(p - g, alpha=w.weight)
            weights += w.weight
        with torch.no_grad():
            for g, t in zip(global_params, total):
                g.add_(t, alpha=1.0 / weights)
    sync()
    return time.perf_counter() - start


def _executors(executor):
    """The executor and those it wraps (``.inner``), outermost first."""
    while executor is not None:
        yield executor
        executor = getattr(executor, "inner", None)


def stacking(executor, rounds: int) -> tuple[float | None, float | None]:
    """``(stacked_fraction, padding_waste)`` of a fit of ``rounds`` rounds.

    From the batched executor's ``stats`` where it keeps them (``rounds``, ``stacked_rounds``, and the
    stacked work, rows x steps x clients, that was real, ``real_work``, and that was padding, ``padded_work``):
    stacked_fraction = stacked_rounds / rounds, padding_waste = padded_work / (real_work + padded_work).
    Otherwise from its ``fallbacks`` (the rounds it ran sequentially, by reason): an executor without
    ``stats`` stacks only equal work, so its padding waste is 0 where it stacked and null where it never did.
    An executor with neither (sequential execution) stacks nothing: (0.0, None).
    """
    chain = list(_executors(executor))
    stats = next((e.stats for e in chain if "stacked_rounds" in (getattr(e, "stats", None) or {})), None)  # a wrapper's may be {}
    if stats is not None:
        total, stacked = int(stats["rounds"]), int(stats["stacked_rounds"])
        work = float(stats["real_work"]) + float(stats["padded_work"])
        return (stacked / total if total else None), (float(stats["padded_work"]) / work if work else None)
    from fl_lightning.executors import BatchedExecutor

    batched = next((e for e in chain if isinstance(e, BatchedExecutor)), None)
    if batched is None:
        return 0.0, None
    stacked = max(0, rounds - sum(batched.fallbacks.values()))
    return stacked / rounds, (0.0 if stacked else None)

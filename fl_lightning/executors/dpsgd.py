"""Record-level DP-SGD's local step (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep
Learning with Differential Privacy", CCS 2016): the gradient the algorithm's step rule consumes
(docs/algorithms.md, equation (RDP.1)):

    g = ( sum_{j in batch} m_j clip_C(grad l(w; x_j)) + z ) / B_i,      z ~ N(0, sigma^2 C^2 I)     (RDP.1)

clip_C(v) = v min(1, C / ||v||), the norm over every trained tensor; m_j masks the padding rows;
B_i the expected batch size q_i n_i (Poisson) or the batch size B (fixed-size).

The records of a step are drawn here (``RecordSampler``), from the client's round seed: Poisson
sampling includes each of the client's n_i records independently with probability q_i (one
uniform per record), fixed-size sampling takes B records uniformly without replacement. A step's
batch holds the drawn records padded with masked rows to a capacity: the draw itself for one
client, the largest draw among the stacked clients for batched execution, so no draw is ever cut
(exact) and the masked rows add exact zeros. The noise is drawn on the CPU in float64 from the
client's own generator, step by step, so sequential and batched execution draw the same numbers.

Per-example gradients are ``torch.func.vmap`` over the batch's rows of ``grad`` of the objective
on a batch of one (the model's loss, or the algorithm's ``local_loss``); for stacked clients one
more ``vmap`` over the clients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap
from torch.utils._pytree import tree_map

from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import derive_seed

SAMPLE_STREAM, NOISE_STREAM = 0xE1, 0xE2
"""Seed streams, within a client's round seed, of the record draws and of the gradient noise."""


@dataclasses.dataclass
class PrivateStep:
    """One local step's records: the batch (``[cap, ...]``, or ``[S, cap, ...]`` stacked), the mask of
    real rows (float, same leading shape) and the number of real rows (per client)."""

    batch: Any
    mask: Tensor
    count: Tensor

    def to(self, device: torch.device) -> PrivateStep:
        """The batch and mask on ``device`` (the count stays where it is)."""
        from fl_lightning.executors.base import to_device

        return dataclasses.replace(self, batch=to_device(self.batch, device), mask=self.mask.to(device))


class RecordSampler:
    """The records of each local step of one client (see the module docstring)."""

    def __init__(self, size: int, rate: float, batch_size: int, sampling: str, seed: int) -> None:
        self.size, self.rate, self.batch_size, self.sampling = size, rate, batch_size, sampling
        self.generator = torch.Generator().manual_seed(derive_seed(seed, SAMPLE_STREAM))

    def draw(self) -> Tensor:
        """The positions (into the client's records) of the next step's batch."""
        if self.sampling == "poisson":
            return torch.nonzero(torch.rand(self.size, generator=self.generator, dtype=torch.float64) < self.rate).flatten()
        return torch.randperm(self.size, generator=self.generator)[: self.batch_size]


def dp_sampler(dp: Any, client: int, seed: int) -> RecordSampler:
    """Client ``client``'s sampler in a round (``dp``: the ``RecordPrivacy`` settings, prepared)."""
    return RecordSampler(int(dp.sizes[client]), float(dp.rates[client]), dp.batch_size, dp.sampling, seed)


def client_noise(dp: Any, clients: Sequence[int], seeds: Sequence[int]) -> tuple[list[NoiseSource], Tensor]:
    """Each client's noise source (std sigma C, from its round seed) and its B_i of (RDP.1)."""
    noise = [NoiseSource(seed, dp.noise_multiplier * dp.clip_norm) for seed in seeds]
    return noise, torch.tensor([dp.denominator(int(c)) for c in clients])


def padded(draws: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(positions [S, cap], mask [S, cap], counts [S])``: the draws padded with position 0 to the
    largest draw (at least one row); padding rows are masked out."""
    cap = max(1, max(len(d) for d in draws))
    positions = torch.zeros(len(draws), cap, dtype=torch.int64)
    mask = torch.zeros(len(draws), cap)
    for s, d in enumerate(draws):
        positions[s, : len(d)] = d
        mask[s, : len(d)] = 1
    return positions, mask, torch.tensor([len(d) for d in draws])


def private_steps(data: Any, clients: Sequence[int], samplers: Sequence[RecordSampler], steps: int, stacked: bool) -> Iterator[PrivateStep]:
    """Each local step's ``PrivateStep`` of one client (``stacked=False``) or of stacked clients."""
    for _ in range(steps):
        positions, mask, counts = padded([s.draw() for s in samplers])
        batch = data.client_records(clients, positions)
        if not stacked:
            batch, mask, counts = tree_map(lambda t: t[0], batch), mask[0], counts[0]
        yield PrivateStep(batch, mask, counts)


def clipped_sum(grads: TensorDict, mask: Tensor, clip_norm: float) -> TensorDict:
    """sum_j m_j clip_C(g_j) of per-example gradients ``grads[k]: [B, ...]`` (the norm over every tensor)."""
    squares = sum(g.flatten(1).square().sum(1) for g in grads.values())
    norms = squares.sqrt()
    factor = clip_norm / torch.clamp(norms, min=clip_norm) * mask.to(norms.dtype)  # min(1, C / ||g_j||) m_j
    return {k: torch.tensordot(factor.to(g.dtype), g, dims=1) for k, g in grads.items()}


def example_grads(objective: Any, loss: Any, params: TensorDict, batch: Any) -> tuple[TensorDict, Tensor]:
    """Per-example gradients ``[B, ...]`` and losses ``[B]`` of one client: vmap over the rows of grad of
    the objective on a batch of one row (the algorithm's ``local_loss`` where it has one)."""

    def one(p: TensorDict, row: Any) -> tuple[Tensor, Tensor]:
        single = tree_map(lambda t: t.unsqueeze(0), row)
        value = objective.at(p, single)[0] if loss is None else loss.at(objective, p, single)[0]
        return value, value.detach()

    grads, (_, values) = vmap(grad_and_value(one, has_aux=True), in_dims=(None, 0), randomness="different")(params, batch)
    return grads, values


def client_sums(objective: Any, loss: Any, params: TensorDict, step: PrivateStep, clip_norm: float) -> tuple[TensorDict, Tensor]:
    """One client's sum_j m_j clip_C(g_j) and sum_j m_j l_j."""
    grads, values = example_grads(objective, loss, params, step.batch)
    return clipped_sum(grads, step.mask, clip_norm), (values * step.mask.to(values.dtype)).sum()


def stacked_sums(objective: Any, loss: Any, params: TensorDict, step: PrivateStep, clip_norm: float) -> tuple[TensorDict, Tensor]:
    """``client_sums`` of stacked clients (``[S, ...]``): vmap over clients of the per-example vmap."""
    ids = loss.client if loss is not None else torch.zeros(step.mask.shape[0], dtype=torch.int64)
    states = loss.client_state if loss is not None else {}

    def one(p: TensorDict, batch: Any, mask: Tensor, cid: Tensor, state: Any) -> tuple[TensorDict, Tensor]:
        bound = None if loss is None else dataclasses.replace(loss, client=cid, client_state=state)
        return client_sums(objective, bound, p, PrivateStep(batch, mask, mask.sum()), clip_norm)

    return vmap(one, randomness="different")(params, step.batch, step.mask, ids, states)


def private_grad_fn(
    objective: Any, step: PrivateStep, noise: Sequence[NoiseSource], denominators: Tensor, clip_norm: float,
    weight_decay: float, record: Any = None, loss: Any = None, stacked: bool = False, name: str = "the algorithm",
):
    """``ctx.grad`` of one local step under record-level DP-SGD: (RDP.1) at the given parameters, plus
    ``weight_decay * w`` (data-independent). ``noise``: one source per client; ``denominators``: B_i per client.
    Evaluated once per step (the accountant's one Gaussian query per step): a second call is refused."""
    calls = []

    def grad(params: TensorDict) -> tuple[Tensor, TensorDict]:
        if calls:
            raise ValueError(
                f"record_privacy: {name} evaluates ctx.grad more than once per local step; each evaluation would be a "
                "further query of the step's records, which the accountant does not compose (docs/privacy.md)"
            )
        calls.append(True)
        sums, loss_sum = (stacked_sums if stacked else client_sums)(objective, loss, params, step, clip_norm)
        out = {}
        for k, v in sums.items():
            shape = v.shape[1:] if stacked else v.shape
            z = torch.stack([src.draw_one(shape) for src in noise]) if stacked else noise[0].draw_one(shape)
            denominator = denominators.to(v.device, torch.float64).view(-1, *([1] * len(shape))) if stacked else float(denominators)
            out[k] = ((v.double() + z.to(v.device)) / denominator).to(v.dtype)
        if weight_decay:
            out = P.add(out, params, weight_decay)
        value = (loss_sum / torch.clamp(step.count.to(loss_sum.device), min=1)).detach()
        if record is not None:
            record.add(value, None, None)
        return value, out

    return grad


class NoiseSource:
    """z ~ N(0, sigma^2 C^2) per coordinate for each step of one client, float64 on the CPU."""

    def __init__(self, seed: int, std: float) -> None:
        self.generator, self.std = torch.Generator().manual_seed(derive_seed(seed, NOISE_STREAM)), std

    def draw_one(self, shape: torch.Size) -> Tensor:
        return torch.randn(shape, generator=self.generator, dtype=torch.float64) * self.std

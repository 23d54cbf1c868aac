"""Multi-process execution: the round's client tasks are split across the ranks of a
Lightning DDP run (gloo on CPU, NCCL on GPU), around any one-process executor.

Every rank receives the same tasks and computes the same assignment of tasks to
ranks (balanced by local steps). Each rank runs its tasks with the wrapped
executor, then the ranks exchange the client results so that every rank
aggregates the same uploads in task order: the global model, the server state
and the client store are identical on every rank and equal to a one-process run.
The warm-up pass over all clients is split the same way.

The exchange is two tensor collectives per round, never pickled tensors:

1. a small header per client slot: an id of the result's *structure* (names,
   shapes and dtypes of its upload and client state; 0 for a
   slot without a result), its mean loss, its training accuracy and its number of steps;
   and one row with the rank's error flag: a rank whose clients raised (a fatal client
   error, divergence, SIGTERM) still takes part in the exchange, so every rank learns of
   it in the same collective; the failing rank re-raises its error and every other rank
   raises ``RankFailed`` with its one-line message (never a hang in the next collective,
   nor a bare "connection closed by peer");
2. the raw bytes of every result's tensors, laid out by that structure.

Structures are learned once (an ``all_gather_object`` of the structure, not of
the tensors) the first round an id appears, then cached. So algorithms whose
uploads differ between clients (FAdamET: only the tracking subset uploads
``y_delta``) need no fallback: each slot carries its own structure id.

An algorithm that declares ``linear_aggregate`` (its aggregate reads the uploads only
through ``upload_sum``, a sum over clients) takes ``run_summed`` instead: each rank sums
its own clients' uploads with the aggregation weights of the round's tasks, and one
``all_reduce`` of a flat float64 buffer carries the headers (each rank's rows, zeros
elsewhere; they also hold each upload's byte count and whether it is finite) and the
sums: the uploads', and for ``train/consistency`` the float64 sum of the ``delta``
uploads and of their squared norms. If a client failed, the survivors' weights differ
and the ranks sum and all-reduce again. Only the client states (the client store is
replicated on every rank) still travel as bytes, and none when the algorithm keeps no
client state (FedAvg): one collective a round, of model size plus 7 numbers per client slot.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.algorithms.base import RoundInfo, declares_capability, defines_local_loss
from fl_lightning.core.errors import RankFailed, RunInterrupted, one_line
from fl_lightning.executors.base import ClientRuntime, Executor
from fl_lightning.reliability.faults import all_finite
from fl_lightning.core.params import TensorDict
from fl_lightning.core.tasks import ClientResult, ClientTask, Payload, SummedRound, subset

_ALIGN = 16  # bytes, a multiple of every element size: slots start aligned for any dtype
Structure = tuple  # (upload, client_state), each nested tuples of (name, shape, dtype)


def assign_clients(steps: list[int], world: int) -> list[list[int]]:
    """Plan positions per rank, balancing the local steps each rank runs.

    Longest first, each to the least-loaded rank (ties: the lower rank), so the
    assignment is a deterministic function of the tasks, the same on every rank.
    With equal steps this is round-robin over positions.
    """
    loads, ranks = [0] * world, [[] for _ in range(world)]
    for position in sorted(range(len(steps)), key=lambda i: (-steps[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += steps[position]
        ranks[rank].append(position)
    return [sorted(positions) for positions in ranks]


def _tensors(result: ClientResult) -> list[Tensor]:
    return [v for part in (result.upload, result.client_state) for td in part.values() for v in td.values()]


def _structure(result: ClientResult) -> Structure:
    def flat(td):
        return tuple((k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in td.items())

    return tuple(tuple((n, flat(td)) for n, td in part.items()) for part in (result.upload, result.client_state))


def _structure_id(structure: Structure) -> int:
    """A stable non-zero 63-bit id (Python's ``hash`` of strings differs between processes)."""
    digest = hashlib.blake2b(repr(structure).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


def _specs(structure: Structure) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of a result's tensors, in ``_tensors`` order."""
    return [e for part in structure for _, td in part for e in td]


@functools.cache
def _layout(structure: Structure) -> tuple[tuple[int, ...], int]:
    """Byte offset of each tensor in a result's slot, and the slot's size.

    A tensor starts at a multiple of its element size, so it can be viewed in place
    (consecutive tensors of one dtype need no padding); a slot's size is a multiple of
    ``_ALIGN``, so slots can follow one another.
    """
    offsets, end = [], 0
    for _, shape, dtype in _specs(structure):
        itemsize = getattr(torch, dtype).itemsize
        offsets.append(-(-end // itemsize) * itemsize)
        end = offsets[-1] + math.prod(shape) * itemsize
    return tuple(offsets), -(-end // _ALIGN) * _ALIGN


def _unpack(buffer: Tensor, structure: Structure) -> tuple[Payload, Payload]:
    """Views into one slot of ``buffer`` (uint8) laid out by ``structure``: (upload, client_state)."""
    offsets = iter(_layout(structure)[0])

    def take(td_structure):
        out = {}
        for key, shape, dtype in td_structure:
            dtype, start = getattr(torch, dtype), next(offsets)
            out[key] = buffer[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        return out

    upload, state = ({n: take(td) for n, td in part} for part in structure)
    return upload, state


def _share_loss_terms(everyone: list[ClientResult], mine: list[ClientResult], runtime: ClientRuntime) -> list[ClientResult]:
    """Every rank's clients' named loss terms (an algorithm's ``local_loss``, logged as ``train/loss/<term>``),
    which the header exchange does not carry: one ``all_gather_object`` a round, only for such algorithms."""
    if not defines_local_loss(runtime.algorithm):
        return everyone
    parts: list[dict[int, dict[str, float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {r.client_id: r.loss_terms for r in mine})
    terms = {cid: t for part in parts for cid, t in part.items()}
    for result in everyone:
        result.loss_terms = terms.get(result.client_id, {})
    return everyone


class DistributedExecutor(Executor):
    """Wraps a one-process executor; runs it unchanged when torch.distributed is not initialised."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.structures: dict[int, Structure] = {}  # learned by all ranks together: identical on every rank
        self.rounds = {"gathered": 0, "summed": 0}  # multi-process exchanges of each kind (warm-up passes gather)

    @property
    def fallbacks(self) -> Counter[str]:
        """The wrapped executor's fallbacks, by reason (``BatchedExecutor``: rounds run sequentially;
        ``SequentialExecutor``: clients run eagerly instead of compiled), found through any executor
        wrapped in between (``MessageExecutor``); the live counter, empty for an executor without one."""
        executor = self.inner
        while not hasattr(executor, "fallbacks") and hasattr(executor, "inner"):
            executor = executor.inner
        return getattr(executor, "fallbacks", Counter())

    @property
    def stats(self) -> dict[str, int]:
        """The wrapped executor's stacking counters (``BatchedExecutor.stats``), found as ``fallbacks`` is; empty for one without."""
        executor = self.inner
        while not hasattr(executor, "stats") and hasattr(executor, "inner"):
            executor = executor.inner
        return getattr(executor, "stats", {})

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> list[ClientResult]:
        if not _distributed():
            return self.inner.run(tasks, info, runtime)
        assignment, mine, results, error = self._run_mine(tasks, info, runtime)
        self.rounds["gathered"] += 1
        facts = {r.client_id: [float(r.upload_bytes), 1.0] for r in results if r.upload_bytes is not None}  # encoded sizes
        gathered, rows, _ = self._exchange(tasks, assignment, mine, results, runtime.device, facts, error=error, round_idx=info.round)
        everyone = [dataclasses.replace(r, upload_bytes=int(row[3])) if r.upload_bytes is None and row[4] else r for r, row in zip(gathered, rows)]
        return _share_loss_terms(everyone, results, runtime)

    @property
    def runs_rounds(self) -> bool:
        return not _distributed() and self.inner.runs_rounds

    def run_round(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime, server: Any):
        return None if _distributed() else self.inner.run_round(tasks, info, runtime, server)

    def run_summed(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> SummedRound | None:
        """The round's uploads summed across the ranks (None: one process, no weights, or an algorithm
        whose aggregate is not declared linear, which ``run`` gathers)."""
        algorithm = runtime.algorithm
        if not _distributed() or runtime.aggregation_weights is None or not declares_capability(algorithm, "linear_aggregate"):
            return None
        assignment, mine, results, error = self._run_mine(tasks, info, runtime)
        self.rounds["summed"] += 1
        device = runtime.device if dist.get_backend() == "nccl" else torch.device("cpu")
        x, uploads = tasks[0].broadcast["x"], [r.upload for r in results]
        delta_sum, delta_sq = _delta_moments([u.get("delta", {}) for u in uploads], x)

        def partial_sums(reporting: list[int]) -> Tensor:  # this rank's sums, with the weights of `reporting`
            weight_of = dict(zip(reporting, runtime.aggregation_weights(reporting).tolist()))
            sums = algorithm.upload_sum(x, uploads, [weight_of[r.client_id] for r in results], info)
            return _flatten(sums, delta_sum, delta_sq, device)

        # Sums weighted as if every task reports travel with the headers: one all_reduce a round.
        facts = {r.client_id: [float(r.sent_bytes), float(all_finite([r.upload]))] for r in results}
        stripped = [dataclasses.replace(r, upload={}) for r in results]
        carry = partial_sums([t.client_id for t in tasks])
        everyone, rows, carry = self._exchange(
            tasks, assignment, mine, stripped, runtime.device, facts, carry, error, info.round
        )
        everyone = _share_loss_terms(everyone, results, runtime)
        if not everyone:  # no client of the round reported, on any rank
            return SummedRound([], {}, [], {}, 0.0, [])
        if len(everyone) < len(tasks):  # a client failed: the survivors' weights differ, sum again
            carry = partial_sums([r.client_id for r in everyone])
            dist.all_reduce(carry)
        sums, delta_sum, delta_sq = _unflatten(carry, algorithm.upload_sum(x, [], [], info), delta_sum, runtime.device)
        return SummedRound(
            everyone, sums, [int(row[3]) for row in rows], delta_sum, delta_sq,
            [r.client_id for r, row in zip(everyone, rows) if not row[4]],
        )  # fmt: skip

    def _run_mine(self, tasks, info, runtime) -> tuple[list[list[int]], list[ClientTask], list[ClientResult], Exception | None]:
        """This rank's share of the tasks (balanced by local steps), run by the wrapped executor, and what it
        raised (the exchange still runs: every rank must reach it, or the others wait there)."""
        assignment = assign_clients([task.num_steps for task in tasks], dist.get_world_size())
        mine = subset(tasks, assignment[dist.get_rank()])
        error = None
        try:
            results = self.inner.run(mine, info, runtime) if mine else []
        except Exception as raised:  # every rank must still reach the exchange, or the others wait there
            results, error = [], raised
        return assignment, mine, results, error

    def _exchange(
        self,
        tasks: Sequence[ClientTask],
        assignment: list[list[int]],
        mine: list[ClientTask],
        results: list[ClientResult],
        local_device: torch.device,
        facts: dict[int, list[float]] | None = None,
        carry: Tensor | None = None,
        error: Exception | None = None,
        round_idx: int = -1,
    ) -> tuple[list[ClientResult], list[list[float]], Tensor | None]:
        """Every rank's results, in task order, on every rank (a client that failed is absent everywhere),
        with their header rows: (mean loss, steps, accuracy, *facts) (facts: two per client, zeros if not given),
        and ``carry`` (float64, 1-D) summed over the ranks in the headers' collective.

        ``error``: what this rank's executor raised; any rank's error stops every rank (``_stop_if_failed``)."""
        world, rank = len(assignment), dist.get_rank()
        device = local_device if dist.get_backend() == "nccl" else torch.device("cpu")
        reported = {r.client_id: r for r in results}  # a client that failed has no result
        by_slot = {slot: reported[t.client_id] for slot, t in enumerate(mine) if t.client_id in reported}
        structures = {slot: _structure(result) for slot, result in by_slot.items()}
        extra = {slot: (facts or {}).get(r.client_id, [0.0, 0.0]) for slot, r in by_slot.items()}
        ids, rows, carry = self._gather_headers(
            by_slot, structures, extra, max(len(a) for a in assignment), device, carry, error, round_idx
        )
        sizes = [sum(_layout(self.structures[i])[1] for i in ids_r if i) for ids_r in ids]
        buffers = _gather_bytes(by_slot, structures, max(sizes), world, device)

        by_position, row_of = {}, {}
        for r in range(world):
            offset = 0
            for slot, (position, structure_id) in enumerate(zip(assignment[r], ids[r])):
                if not structure_id:
                    continue
                structure = self.structures[structure_id]
                size = _layout(structure)[1]
                row_of[position] = rows[r][slot]
                if r == rank:  # this rank's own results, as they are
                    by_position[position] = by_slot[slot]
                else:
                    upload, state = _unpack(buffers[r][offset : offset + size], structure)
                    if device != local_device:
                        upload = {n: {k: v.to(local_device) for k, v in td.items()} for n, td in upload.items()}
                    loss, steps, accuracy = rows[r][slot][:3]
                    by_position[position] = ClientResult(tasks[position].client_id, upload, state, int(steps), loss, accuracy)
                offset += size
        return [by_position[p] for p in sorted(by_position)], [row_of[p] for p in sorted(by_position)], carry

    @staticmethod
    def _stop_if_failed(failed: list[int], error: Exception | None, round_idx: int, world: int) -> None:
        """Raise on every rank when any rank's executor raised (every rank sees the same flags, so all
        take this branch together): the failing rank its own error, the others ``RankFailed`` naming it,
        or the same stop when it was a stop signal."""
        if not failed:
            return
        messages: list[tuple[str, str | None] | None] = [None] * world
        signal_name = error.signal_name if isinstance(error, RunInterrupted) else None
        dist.all_gather_object(messages, (one_line(error), signal_name) if error is not None else None)
        if error is not None:
            raise error
        message, signal_name = messages[failed[0]]
        if signal_name is not None:  # a stop signal another rank saw first: this rank stops the same way
            stop = RunInterrupted(round_idx, f"on rank {failed[0]} (the round is not aggregated)", signal_name)
            stop.unsaved = "no stop checkpoint under DDP (the ranks stop at different steps)"
            raise stop
        raise RankFailed(f"round {round_idx}: rank {failed[0]} failed: {message}")

    def _gather_headers(
        self, by_slot: dict[int, ClientResult], structures: dict[int, Structure], extra: dict[int, list[float]],
        slots: int, device: torch.device, carry: Tensor | None = None, error: Exception | None = None, round_idx: int = -1,
    ) -> tuple[list[list[int]], list[list[list[float]]], Tensor | None]:
        """Per rank and slot: the structure id (0: no result) and (mean loss, steps, accuracy, *extra).
        Learns new structures.

        One float64 [slots + 1, 6] all_gather; the id travels as the bits of an int64; the last row's
        first entry is the rank's error flag. With ``carry`` (partial sums to add up), one all_reduce of
        [every rank's header (zeros but its own) | every rank's error flag | carry] instead: each header
        value has one non-zero term, so the sum is exact; the id travels as two exact 32-bit halves.
        Any rank's error is raised on every rank.
        """
        ids, meta, local = [0] * slots, [[0.0] * 5 for _ in range(slots)], {}
        for slot, result in by_slot.items():
            structure = structures[slot]
            ids[slot] = _structure_id(structure)
            local[ids[slot]] = structure
            meta[slot] = [result.mean_loss, float(result.num_steps), result.accuracy, *extra[slot]]
        world, failed_flag = dist.get_world_size(), float(error is not None)
        if carry is None:
            id_bits = torch.tensor(ids, dtype=torch.int64).view(torch.float64)[:, None]
            flag = torch.tensor([[failed_flag] + [0.0] * 5], dtype=torch.float64)
            header = torch.cat([torch.cat([id_bits, torch.tensor(meta, dtype=torch.float64)], dim=1), flag]).to(device)
            headers = [torch.empty_like(header) for _ in range(world)]
            dist.all_gather(headers, header)
            headers = [h.cpu() for h in headers]
            self._stop_if_failed([r for r, h in enumerate(headers) if h[-1, 0] != 0], error, round_idx, world)
            headers = [h[:-1] for h in headers]
            ids = [h[:, 0].contiguous().view(torch.int64).tolist() for h in headers]
        else:
            halves = [[float(i >> 32), float(i & 0xFFFFFFFF)] for i in ids]
            block = torch.zeros(world, slots, 7, dtype=torch.float64)
            block[dist.get_rank()] = torch.tensor([h + m for h, m in zip(halves, meta)], dtype=torch.float64).view(slots, 7)
            flags = torch.zeros(world, dtype=torch.float64)
            flags[dist.get_rank()] = failed_flag
            flat = torch.cat([block.reshape(-1).to(device), flags.to(device), carry])
            dist.all_reduce(flat)
            flags = flat[block.numel() : block.numel() + world].cpu()
            self._stop_if_failed([r for r in range(world) if flags[r] != 0], error, round_idx, world)
            carry, block = flat[block.numel() + world :], flat[: block.numel()].cpu().view(world, slots, 7)
            ids = [[(int(hi) << 32) | int(lo) for hi, lo in b[:, :2].tolist()] for b in block]
            headers = [b[:, 1:] for b in block]  # like the all_gather's: one id column, then the values
        # Every rank sees the same ids and has the same cache, so all take this branch together.
        new = {i for ids_r in ids for i in ids_r if i and i not in self.structures}
        if new:  # a structure seen for the first time: exchange it once (objects, no tensors)
            gathered: list[dict | None] = [None] * len(headers)
            dist.all_gather_object(gathered, {i: s for i, s in local.items() if i in new})
            for part in gathered:
                self.structures.update(part)
        return ids, [h[:, 1:].tolist() for h in headers], carry


def _gather_bytes(
    by_slot: dict[int, ClientResult], structures: dict[int, Structure], size: int, world: int, device: torch.device
) -> list[Tensor]:
    """Every rank's result tensors as raw bytes (uint8 [size] per rank), slot after slot, by ``_layout``."""
    pieces, end, zeros = [], 0, torch.zeros(size, dtype=torch.uint8, device=device)
    for slot in sorted(by_slot):
        offsets, slot_size = _layout(structures[slot])
        start = end
        for offset, tensor in zip(offsets, _tensors(by_slot[slot])):
            if start + offset > end:
                pieces.append(zeros[: start + offset - end])
            pieces.append(tensor.detach().reshape(-1).to(device).view(torch.uint8))
            end = start + offset + pieces[-1].numel()
        if start + slot_size > end:
            pieces.append(zeros[: start + slot_size - end])
        end = start + slot_size
    buffer = torch.cat([*pieces, zeros[: size - end]]) if pieces else zeros
    buffers = [torch.empty_like(buffer) for _ in range(world)]
    if size:  # 0 when no client of the round completed
        dist.all_gather(buffers, buffer)
    return buffers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _delta_moments(deltas: list[TensorDict], like: TensorDict) -> tuple[TensorDict, float]:
    """sum_i delta_i (float64) and sum_i ||delta_i||^2: ``train/consistency`` from sums (``consistency_from_sums``)."""
    if not deltas:
        return {k: torch.zeros(v.shape, dtype=torch.float64, device=v.device) for k, v in like.items()}, 0.0
    # Vectorised over clients: per tensor name, one stack, one cast, one sum and one dot (a handful of
    # ops a name instead of three a client and name: at S = 50 the per-client loop cost milliseconds).
    total, squares = {}, []
    for k in like:
        present = [delta[k] for delta in deltas if k in delta]  # an upload without a model delta adds nothing
        if not present:
            total[k] = torch.zeros(like[k].shape, dtype=torch.float64, device=like[k].device)
            continue
        stacked = torch.stack(present).double()
        total[k] = stacked.sum(0)
        flat = stacked.reshape(-1)
        squares.append(torch.dot(flat, flat))
    return total, float(torch.stack(squares).sum()) if squares else 0.0  # on the tensors' device: one sync, at the end


def _flatten(sums: Payload, delta_sum: TensorDict, delta_sq: float, device: torch.device) -> Tensor:
    """A rank's partial sums as one flat float64 buffer on ``device`` (to all-reduce)."""
    tensors = [v for td in sums.values() for v in td.values()] + list(delta_sum.values())
    scalar = torch.tensor([delta_sq], dtype=torch.float64, device=device)
    return torch.cat([*(t.to(device, torch.float64).reshape(-1) for t in tensors), scalar])


def _unflatten(
    flat: Tensor, like: Payload, delta_like: TensorDict, local_device: torch.device
) -> tuple[Payload, TensorDict, float]:
    """``_flatten``'s inverse, each tensor cast back to the dtype and shape of ``like``'s / ``delta_like``'s."""
    tensors = [v for td in like.values() for v in td.values()] + list(delta_like.values())
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape).to(local_device, t.dtype))
        offset += t.numel()
    pieces = iter(out)
    reduced = {n: {k: next(pieces) for k in td} for n, td in like.items()}
    return reduced, {k: next(pieces) for k in delta_like}, float(flat[-1])

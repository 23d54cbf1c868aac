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
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.errors import RankFailed, RunInterrupted, one_line
from fl_lightning.executors.base import ClientRuntime, Executor
from fl_lightning.tasks import ClientResult, ClientTask, Payload

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


class DistributedExecutor(Executor):
    """Wraps a one-process executor; runs it unchanged when torch.distributed is not initialised."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.structures: dict[int, Structure] = {}  # learned by all ranks together: identical on every rank

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> list[ClientResult]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.inner.run(tasks, info, runtime)
        assignment = assign_clients([task.num_steps for task in tasks], dist.get_world_size())
        mine = [tasks[i] for i in assignment[dist.get_rank()]]
        error = None
        try:
            results = self.inner.run(mine, info, runtime) if mine else []
        except Exception as raised:  # every rank must still reach the exchange, or the others wait there
            results, error = [], raised
        return self._exchange(tasks, assignment, mine, results, runtime.device, error, info.round)

    def _exchange(
        self,
        tasks: Sequence[ClientTask],
        assignment: list[list[int]],
        mine: list[ClientTask],
        results: list[ClientResult],
        local_device: torch.device,
        error: Exception | None = None,
        round_idx: int = -1,
    ) -> list[ClientResult]:
        """Every rank's results, in task order, on every rank (a client that failed is absent everywhere).

        ``error``: what this rank's executor raised; any rank's error stops every rank (see the module)."""
        world, rank = len(assignment), dist.get_rank()
        device = local_device if dist.get_backend() == "nccl" else torch.device("cpu")
        reported = {r.client_id: r for r in results}  # a client that failed has no result
        by_slot = {slot: reported[t.client_id] for slot, t in enumerate(mine) if t.client_id in reported}
        structures = {slot: _structure(result) for slot, result in by_slot.items()}
        ids, rows = self._gather_headers(by_slot, structures, max(len(a) for a in assignment), device, error, round_idx)
        sizes = [sum(_layout(self.structures[i])[1] for i in ids_r if i) for ids_r in ids]
        buffers = _gather_bytes(by_slot, structures, max(sizes), world, device)

        by_position = {}
        for r in range(world):
            offset = 0
            for slot, (position, structure_id) in enumerate(zip(assignment[r], ids[r])):
                if not structure_id:
                    continue
                structure = self.structures[structure_id]
                size = _layout(structure)[1]
                if r == rank:  # this rank's own results, as they are
                    by_position[position] = by_slot[slot]
                else:
                    upload, state = _unpack(buffers[r][offset : offset + size], structure)
                    if device != local_device:
                        upload = {n: {k: v.to(local_device) for k, v in td.items()} for n, td in upload.items()}
                    loss, steps, accuracy = rows[r][slot]
                    by_position[position] = ClientResult(tasks[position].client_id, upload, state, int(steps), loss, accuracy)
                offset += size
        return [by_position[p] for p in sorted(by_position)]

    def _gather_headers(
        self, by_slot: dict[int, ClientResult], structures: dict[int, Structure], slots: int, device: torch.device,
        error: Exception | None = None, round_idx: int = -1,
    ) -> tuple[list[list[int]], list[list[list[float]]]]:
        """Per rank and slot: the structure id (0: no result) and (mean loss, steps, accuracy). Learns new structures.

        One float64 [slots + 1, 4] all_gather; the id travels as the bits of an int64; the last row's first
        entry is the rank's error flag (any rank's error is raised on every rank).
        """
        ids, meta, local = [0] * slots, [[0.0, 0.0, 0.0] for _ in range(slots)], {}
        for slot, result in by_slot.items():
            structure = structures[slot]
            ids[slot] = _structure_id(structure)
            local[ids[slot]] = structure
            meta[slot] = [result.mean_loss, float(result.num_steps), result.accuracy]
        id_bits = torch.tensor(ids, dtype=torch.int64).view(torch.float64)[:, None]
        flag = torch.tensor([[float(error is not None), 0.0, 0.0, 0.0]], dtype=torch.float64)
        header = torch.cat([torch.cat([id_bits, torch.tensor(meta, dtype=torch.float64).view(-1, 3)], dim=1), flag]).to(device)
        headers = [torch.empty_like(header) for _ in range(dist.get_world_size())]
        dist.all_gather(headers, header)
        headers = [h.cpu() for h in headers]
        failed = [r for r, h in enumerate(headers) if h[-1, 0] != 0]
        if failed:  # every rank sees the same flags, so all take this branch together
            messages: list[tuple[str, str | None] | None] = [None] * len(headers)
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
        headers = [h[:-1] for h in headers]
        ids = [h[:, 0].contiguous().view(torch.int64).tolist() for h in headers]
        # Every rank sees the same ids and has the same cache, so all take this branch together.
        new = {i for ids_r in ids for i in ids_r if i and i not in self.structures}
        if new:  # a structure seen for the first time: exchange it once (objects, no tensors)
            gathered: list[dict | None] = [None] * len(headers)
            dist.all_gather_object(gathered, {i: s for i, s in local.items() if i in new})
            for part in gathered:
                self.structures.update(part)
        return ids, [h[:, 1:].tolist() for h in headers]


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

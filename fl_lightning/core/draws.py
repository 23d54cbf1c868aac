"""Counter-based minibatch draws: a client's shuffles as a pure function of counters.

Client i's pass p over its n_i local samples visits them in the order of the keys
``key(s_i, p, j)``, j = 0 .. n_i - 1 (ties, which are rare, by j), where s_i is the client's
round seed and ``key`` a 40-bit hash of the three counters (SplitMix64's output function,
Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014;
docs/algorithms.md §29). Nothing is stateful, so

* one client's passes and a whole round's clients' passes are the same numbers, drawn in one
  batched sort for all clients (``pass_grid``), and
* a pass can be drawn without the passes before it (long rounds draw their steps in blocks).

Local steps are then read off the passes (``fixed_steps``, ``epoch_steps``): K batches of B from
reshuffled passes (a pass's remainder of fewer than B samples skipped), or E epochs of
ceil(n_i / B) batches (the last one of a pass short).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

KEY_BITS = 40
"""Bits of a sample's sort key (the top bits of its 64-bit hash)."""

# uint64 arithmetic wraps modulo 2**64 and shifts are logical: SplitMix64 as written. NumPy rather than torch:
# a round's draws are a few dozen small elementwise ops, and NumPy's cost per op is a fraction of torch's.
_GAMMA, _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _DROP = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(64 - KEY_BITS)
_PAD_KEY = np.uint64(1 << KEY_BITS)
_POSITION_BITS = 63 - KEY_BITS  # a key (at most _PAD_KEY: KEY_BITS + 1 bits) and a position packed in 64 bits


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``x + gamma`` (uint64)."""
    z = x + _GAMMA
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


def _uint64(values) -> np.ndarray:
    """Non-negative integers (a list, an int64 tensor or array) as uint64."""
    if isinstance(values, Tensor):
        values = values.numpy()
    return np.asarray(values).astype(np.uint64)


def _int64(values) -> np.ndarray:
    return values.numpy() if isinstance(values, Tensor) else np.asarray(values, dtype=np.int64)


def pass_grid(seeds, sizes, first_pass, num_passes: int) -> np.ndarray:
    """``[S, num_passes, max(sizes)]`` int64: row (i, q) holds client i's pass ``first_pass[i] + q``, a permutation
    of ``0 .. sizes[i] - 1`` (then padding: positions >= sizes[i], in order). One sort of every row at once."""
    sizes = _int64(sizes)
    width = int(sizes.max()) if len(sizes) else 0
    passes = _uint64(first_pass).reshape(-1, 1) + np.arange(num_passes, dtype=np.uint64)
    segment = mix64(mix64(_uint64(seeds)).reshape(-1, 1) ^ passes)[..., None]  # [S, P, 1]: one hash per pass
    position = np.arange(width, dtype=np.uint64)
    keys = mix64(segment ^ position) >> _DROP
    keys = np.where(position < sizes.astype(np.uint64).reshape(-1, 1, 1), keys, _PAD_KEY)  # padding after every real key
    return _stable_argsort(keys)


def _stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, axis=-1, kind="stable")`` of keys <= ``_PAD_KEY``: each key and its position packed in one
    uint64 (key above, position below), so the packed values are distinct and one plain sort of them orders by key,
    ties by position, exactly as the stable argsort; 4x to 6x faster on CPU (a round's slowest draw op). Rows wider
    than the position bits take the stable argsort."""
    width = keys.shape[-1]
    if width > 1 << _POSITION_BITS:
        return np.argsort(keys, axis=-1, kind="stable")
    packed = (keys << np.uint64(_POSITION_BITS)) | np.arange(width, dtype=np.uint64)
    packed.sort(axis=-1)
    return (packed & np.uint64((1 << _POSITION_BITS) - 1)).astype(np.int64)


def shuffles(seeds, sizes, first_pass, num_passes) -> Tensor:
    """Client i's passes ``first_pass[i] .. first_pass[i] + num_passes[i] - 1`` over its ``sizes[i]`` samples,
    each a permutation of ``0 .. sizes[i] - 1``, concatenated client after client: int64
    ``[sum(sizes * num_passes)]`` (``pass_grid`` without its padding)."""
    sizes, num_passes = _int64(sizes), _int64(num_passes)
    if int((sizes * num_passes).sum()) == 0:
        return torch.empty(0, dtype=torch.int64)
    grid = pass_grid(seeds, sizes, first_pass, int(num_passes.max()))
    keep = (np.arange(grid.shape[1]).reshape(1, -1, 1) < num_passes.reshape(-1, 1, 1)) & (np.arange(grid.shape[2]) < sizes.reshape(-1, 1, 1))
    return torch.from_numpy(grid[keep])


def fixed_steps(seeds, sizes, batch_size: int, first_step: int, num_steps: int) -> Tensor:
    """Positions (into each client's samples) of steps ``first_step .. first_step + num_steps - 1``: int64
    ``[S, num_steps, batch_size]``. Step k of client i is its k-th whole batch of ``batch_size`` in the
    sequence of its passes, each pass's last ``sizes[i] % batch_size`` samples skipped (requires
    ``batch_size <= sizes[i]``)."""
    sizes = _int64(sizes)
    per_pass = (sizes // batch_size).reshape(-1, 1, 1)  # whole batches a pass holds
    if (per_pass < 1).any():
        raise ValueError(f"batch_size={batch_size} exceeds a client's {int(sizes.min())} samples")
    step = np.arange(first_step, first_step + num_steps).reshape(1, -1, 1)
    pass_of = step // per_pass
    first = pass_of[:, :1]
    grid = pass_grid(seeds, sizes, first.reshape(-1), int((pass_of[:, -1:] - first).max()) + 1)
    rank = (step - pass_of * per_pass) * batch_size + np.arange(batch_size)  # rank within the pass
    return torch.from_numpy(_pick(grid, pass_of - first, rank))


def _pick(grid: np.ndarray, passes: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """``grid[i, passes[i, ...], ranks[i, ...]]`` for every client i (``passes`` and ``ranks`` broadcast): one ``take``
    of flat indices, at half the cost of indexing with three arrays."""
    num_clients, num_passes, width = grid.shape
    return grid.reshape(-1).take((np.arange(num_clients).reshape(-1, 1, 1) * num_passes + passes) * width + ranks)


def epoch_steps(seeds, sizes, batch_size: int | None, epochs: int) -> tuple[Tensor, Tensor]:
    """``epochs`` passes of each client cut into batches of ``batch_size`` (``None``: the whole set, unshuffled),
    the last of a pass short: ``(positions [S, K, B], rows [S, K])``, K the largest client's
    ``epochs * ceil(n_i / B)`` and B the largest batch; client i's steps beyond its own K_i hold a real position
    of the client and its rows beyond ``rows[i, k]`` the step's first position (padding, for the caller to mask)."""
    sizes = _int64(sizes)
    num_clients = len(sizes)
    if batch_size is None:  # full batch: every step the client's samples in order
        col = np.arange(int(sizes.max())).reshape(1, 1, -1)
        positions = np.broadcast_to(np.where(col < sizes.reshape(-1, 1, 1), col, 0), (num_clients, epochs, col.shape[-1]))
        rows = np.broadcast_to(sizes.reshape(-1, 1), (num_clients, epochs))
        return torch.from_numpy(positions.copy()), torch.from_numpy(rows.copy())
    per_pass = (-(-sizes // batch_size)).reshape(-1, 1)  # ceil
    depth, width = int((epochs * per_pass).max()), int(min(batch_size, int(sizes.max())))
    grid = pass_grid(seeds, sizes, np.zeros(num_clients, dtype=np.int64), epochs)
    step = np.arange(depth).reshape(1, -1)
    pass_of = step // per_pass
    start = (step - pass_of * per_pass) * batch_size  # the batch's first rank in its pass
    rows = np.where(pass_of < epochs, np.clip(sizes.reshape(-1, 1) - start, 0, batch_size), 0)
    col = np.arange(width).reshape(1, 1, -1)
    rank = start[..., None] + np.where(col < rows[..., None], col, 0)
    rank = np.where(rows[..., None] > 0, rank, 0)  # a step past K_i: the first sample of the last pass
    positions = _pick(grid, np.minimum(pass_of, epochs - 1)[..., None], rank)
    return torch.from_numpy(positions), torch.from_numpy(rows)


def num_local_steps(size: int, batch_size: int | None, steps: int | None, epochs: int | None) -> int:
    """K of a client of ``size`` samples: ``steps``, or ``epochs`` passes of ``ceil(size / batch_size)`` batches
    (one batch a pass for ``batch_size`` None)."""
    if steps is not None:
        return steps
    return epochs * (1 if batch_size is None else math.ceil(size / batch_size))


def epochs_local_steps(sizes: Tensor, batch_size: int | None, epochs: int) -> Tensor:
    """``num_local_steps`` of clients of ``sizes`` samples (int64 ``[S]``) running ``epochs`` passes: int64 ``[S]``."""
    return torch.full_like(sizes, epochs) if batch_size is None else epochs * -(-sizes // batch_size)


def client_positions(
    seed: int, size: int, batch_size: int | None, steps: int | None, epochs: int | None, block: int | None = None
) -> Iterator[Tensor]:
    """Positions (into a client's ``size`` samples) of each of its local steps in a round, step by step: the whole
    set in order for ``batch_size`` None (or ``batch_size >= size`` with ``steps``), ``epoch_steps``' batches with
    ``epochs``, else ``fixed_steps``' (drawn ``block`` steps at a time where given: bounded memory)."""
    num_steps = num_local_steps(size, batch_size, steps, epochs)
    if batch_size is None or (steps is not None and batch_size >= size):
        whole = torch.arange(size)
        for _ in range(num_steps):
            yield whole
        return
    if epochs is not None:
        positions, rows = epoch_steps([seed], [size], batch_size, epochs)
        for k, real in enumerate(rows[0].tolist()):
            yield positions[0, k, :real]
        return
    block = block or num_steps
    for first in range(0, num_steps, block):
        yield from fixed_steps([seed], [size], batch_size, first, min(block, num_steps - first))[0]

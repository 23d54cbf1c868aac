"""Masked stacking: clients with unequal local work stacked by padding (docs/performance.md, "Masked stacking").

Each client's steps are padded to the round's largest K and its batches to the largest B. A padded row
has target ``IGNORE_TARGET`` (no loss, no gradient, not counted); a padded step is masked: ``keep_where``
keeps the client's parameters and local state as they were, by ``torch.where`` (never a product with 0,
which turns an infinite or NaN value of the discarded step into NaN). Padding costs arithmetic; where a
round would waste more than a cap, ``buckets`` splits its clients into a few groups of similar work,
stacked separately. Stacked in decreasing K, a round's stack shrinks as its clients finish (``stack_sizes``):
the padded steps of the clients that are done are not computed at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core.client_data import IGNORE_TARGET
from fl_lightning.core.objective import predicted


def keep_where(mask: Tensor, new: Any, old: Any) -> Any:
    """``new`` where ``mask`` is True, else ``old``, leaf by leaf of nested dicts, lists and tuples.

    ``mask`` is bool ``[S]`` over the leading client dimension (or 0-dim for one client under vmap);
    a leaf that is not a tensor is ``new``'s (rules keep counters and flags equal across clients)."""
    if isinstance(new, dict):
        return {k: keep_where(mask, v, old[k]) if k in old else v for k, v in new.items()}
    if isinstance(new, list | tuple):
        return type(new)(keep_where(mask, a, b) for a, b in zip(new, old))
    if isinstance(new, Tensor) and isinstance(old, Tensor):
        if new is old:
            return new
        if mask.dim() and (new.dim() == 0 or new.shape[0] != mask.shape[0]):  # a tensor shared by the clients (no client dimension)
            if new.shape == old.shape and torch.equal(new, old):
                return new
            raise Unmaskable("the rule's local state holds a tensor without the client dimension that changes in its local steps")
        return torch.where(mask.view(*mask.shape, *[1] * (new.dim() - mask.dim())), new, old)
    return new


class Unmaskable(Exception):
    """A padded step cannot be masked per client (the message says why): the round runs sequentially."""


def power_of_two(n: int) -> int:
    """The bucket of a padded size under compiled execution: the next power of two (>= n)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Work:
    """A client's local work this round: ``steps`` (K_i), ``rows`` (its largest batch) and ``real`` (the rows of all its steps)."""

    steps: int
    rows: int
    real: int


def client_work(size: int, batch_size: int | None, steps: int | None, epochs: int | None, num_steps: int) -> Work:
    """The work of a client of ``size`` samples running ``num_steps`` steps (a straggler's budget cut short):
    batches of ``batch_size`` (the whole set where ``batch_size`` is None, or where it exceeds ``size`` with
    ``local.steps``), and with ``local.epochs`` passes whose last batch holds the remainder."""
    if batch_size is None or (steps is not None and batch_size >= size):
        return Work(num_steps, size, num_steps * size)
    if steps is not None:
        return Work(num_steps, batch_size, num_steps * batch_size)
    per_pass = math.ceil(size / batch_size)
    full, part = divmod(num_steps, per_pass)
    real = full * size + min(part * batch_size, size)
    return Work(num_steps, min(batch_size, size), real)


def largest_rows(sizes: Tensor, batch_size: int | None) -> int:
    """The largest ``client_work(...).rows`` of clients of ``sizes`` samples (int64 ``[S]``, S >= 1), whatever their
    steps: a client's batch is its whole set where ``batch_size`` is None, else at most ``batch_size`` rows."""
    largest = int(sizes.max())
    return largest if batch_size is None else min(batch_size, largest)


def padded_area(works: Sequence[Work], bucket=None) -> int:
    """Rows x steps x clients of ``works`` stacked: each padded to the largest K and B (``bucket``ed where given)."""
    steps, rows = max(w.steps for w in works), max(w.rows for w in works)
    if bucket is not None:
        steps, rows = bucket(steps), bucket(rows)
    return len(works) * steps * rows


def waste(works: Sequence[Work], bucket=None) -> float:
    """The share of the stacked area that is padding."""
    area = padded_area(works, bucket)
    return 1.0 - sum(w.real for w in works) / area if area else 0.0


def buckets(works: Sequence[Work], cap: float, most: int, bucket=None) -> list[list[int]]:
    """The clients (indices into ``works``) in groups stacked separately: one group unless it would waste more
    than ``cap`` of its area on padding; then at most ``most`` groups of clients adjacent in (K, B) order,
    chosen to minimise the total padded area (an exact dynamic program over the sorted clients)."""
    everyone = list(range(len(works)))
    if most <= 1 or len(works) <= 1 or waste(works, bucket) <= cap:
        return [everyone]
    order = sorted(everyone, key=lambda i: (works[i].steps, works[i].rows))
    n = len(order)
    area = [[0] * (n + 1) for _ in range(n + 1)]  # area[i][j]: the sorted clients i .. j-1 in one group
    for i in range(n):
        steps = rows = 0
        for j in range(i + 1, n + 1):
            steps, rows = max(steps, works[order[j - 1]].steps), max(rows, works[order[j - 1]].rows)
            padded = (steps, rows) if bucket is None else (bucket(steps), bucket(rows))
            area[i][j] = (j - i) * padded[0] * padded[1]
    best = [[math.inf] * (n + 1) for _ in range(most + 1)]
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    best[0][0] = 0
    for g in range(1, most + 1):
        for j in range(1, n + 1):
            for i in range(g - 1, j):
                cost = best[g - 1][i] + area[i][j]
                if cost < best[g][j]:
                    best[g][j], cut[g][j] = cost, i
    groups = min(range(1, most + 1), key=lambda g: (best[g][n], g))
    bounds, j = [], n
    for g in range(groups, 0, -1):
        i = cut[g][j]
        bounds.append((i, j))
        j = i
    return [sorted(order[i:j]) for i, j in reversed(bounds)]


def stack_sizes(steps: Sequence[int], stacked: int, bucket=power_of_two) -> list[int] | None:
    """The stack's size at each step of a masked round whose clients are stacked in decreasing K (``steps``, each
    client's K_i; ``stacked``: the stack's size at the first step, padding included): at step k the clients still
    running are the first a_k = #{i: K_i > k}, so the stack shrinks to ``bucket(a_k)`` (never growing back; compiled
    execution's buckets bound the number of programs). None where ``steps`` is not in decreasing order."""
    if any(a < b for a, b in zip(steps, steps[1:])):
        return None
    sizes, size = [], stacked
    for k in range(max(steps, default=0)):
        running = sum(1 for own in steps if own > k)
        size = min(size, max(1, bucket(running)))
        sizes.append(size)
    return sizes


def set_aside(sizes: Sequence[int], clients: int) -> int:
    """Client-steps a shrinking stack of ``clients`` did not compute: ``sum_k clients - min(clients, sizes[k])``
    (a compiled stack's first size may exceed the real clients: its padding)."""
    return sum(clients - min(clients, size) for size in sizes)


class ShrinkingStack:
    """The stack of a masked round whose clients run in decreasing K, shrinking as they finish (``stack_sizes``):
    the eager elementwise rule and the compiled step program run their steps through it alike.

    At step k only the first ``sizes[k]`` clients run. The rows past them of what the steps carry (parameters,
    local state) are set aside as views, and joined back once after the last step (``joined``); what the steps
    only read (ids, client state, personal tensors, the step mask, the step's batch) is cut to the running rows.
    """

    def __init__(self, sizes: Sequence[int], stacked: int) -> None:
        self.sizes, self.running = sizes, stacked
        self._aside: list[Any] = []  # the carried rows of the clients set aside, last clients first

    def shrink(self, step: int, carried: Any, read: Any) -> tuple[Any, Any] | None:
        """``carried`` and ``read`` cut to step ``step``'s running clients, the carried rows past them set aside;
        None where the stack keeps its size at this step."""
        size = self.sizes[step]
        if size >= self.running:
            return None
        self._aside.append(leading_rows(carried, size, self.running))
        self.running = size
        return leading_rows((carried, read), 0, size)

    def rows(self, tree: Any) -> Any:
        """``tree``'s rows of the running clients (views)."""
        return leading_rows(tree, 0, self.running)

    def joined(self, carried: Any) -> Any:
        """The carried tensors of every client: the running clients' with the rows set aside after them."""
        return joined([carried, *reversed(self._aside)]) if self._aside else carried


def leading_rows(tree: Any, start: int, stop: int) -> Any:
    """``tree``'s tensors' leading rows ``start:stop`` (views), leaf by leaf of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        return {k: leading_rows(v, start, stop) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(leading_rows(v, start, stop) for v in tree)
    return tree[start:stop] if isinstance(tree, Tensor) else tree


def joined(parts: list[Any]) -> Any:
    """Equally-structured trees' tensors concatenated along their leading rows (the inverse of ``leading_rows``' splits)."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: joined([p[k] for p in parts]) for k in first}
    if isinstance(first, list | tuple):
        return type(first)(joined(list(leaves)) for leaves in zip(*parts))
    return torch.cat(parts) if isinstance(first, Tensor) else first


def all_stacked(tree: Any, size: int) -> bool:
    """Whether every tensor of ``tree`` has a leading client dimension of ``size`` (nothing shared by the clients)."""
    if isinstance(tree, dict):
        return all(all_stacked(v, size) for v in tree.values())
    if isinstance(tree, list | tuple):
        return all(all_stacked(v, size) for v in tree)
    return not isinstance(tree, Tensor) or (tree.dim() > 0 and tree.shape[0] == size)


def _steps_by_clients(values: list[Tensor], clients: int) -> Tensor:
    """Per-step ``[S_k]`` values as ``[K, S]``: a step of a shrunk stack (``stack_sizes``) ran its first S_k clients
    only, so its row is zero-filled after them (those clients are done: the step mask excludes them)."""
    if all(len(v) == clients for v in values):
        return torch.stack(values)
    return torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=0)


def masked_round_means(losses: list[Tensor], step_mask: Tensor) -> Tensor:
    """Each client's mean recorded loss over its real steps (``losses``: one ``[S]`` per step, or the first ``S_k``
    clients' of a shrunk stack; ``step_mask`` ``[S, K]``)."""
    values, mask = _steps_by_clients(losses, step_mask.shape[0]), step_mask.t().to(losses[0].device)
    return torch.where(mask, values, torch.zeros_like(values)).sum(0) / mask.sum(0)


def masked_correct(outputs: list[Tensor], targets: list[Tensor], step_mask: Tensor) -> Tensor:
    """Each client's correct predictions over its real steps' real rows (padded rows' targets never match)."""
    correct = _steps_by_clients([(predicted(out) == target).sum(-1) for out, target in zip(outputs, targets)], step_mask.shape[0])  # [K, S]
    return torch.where(step_mask.t().to(correct.device), correct, torch.zeros_like(correct)).sum(0)


def masked_term_means(terms: list[dict[str, Tensor]], step_mask: Tensor) -> dict[str, list[float]]:
    """``StepRecord.term_means`` over each client's real steps: each term's per-client means."""
    if not terms:
        return {}
    return {k: masked_round_means([t[k] for t in terms], step_mask).tolist() for k in terms[0]}


class StepBatches:
    """A stacked round's step batches, each moved to the device as it is drawn (``move``), iterated once.

    A stack that shrinks as its clients finish (``stack_sizes``) reads them through ``cut`` instead: step k's
    batch holds only its first ``sizes[k]`` clients, where the data can cut (``PaddedBatches.leading``), so the
    rows of the clients that are done are never gathered; else the whole batches, which the stack cuts itself.
    """

    def __init__(self, batches: Iterator[Any], move: Callable[[Any], Any], leading: Callable[[Sequence[int]], Iterator[Any]] | None = None):
        self._batches, self._move, self._leading = batches, move, leading

    @property
    def cuts(self) -> bool:
        """Whether ``cut`` draws only the running clients' rows."""
        return self._leading is not None

    def __iter__(self) -> Iterator[Any]:
        return map(self._move, self._batches)

    def cut(self, sizes: Sequence[int]) -> Iterator[Any]:
        """The batches, step k's cut to at most its first ``sizes[k]`` clients where the data can (a fresh draw)."""
        return iter(self) if self._leading is None else map(self._move, self._leading(sizes))


def padded_full_batches(batches: Sequence[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Clients' whole training sets (``client_full_batch``: ``(inputs..., targets)`` of n_i rows each) as one
    ``[S, max n_i, ...]`` batch: a padded row repeats the client's first sample with target ``IGNORE_TARGET``,
    so each client's loss is the mean over its own rows (the stacked full gradients of ``ctx.full_grad``).
    Raises ``Unmaskable`` where rows are padded and the targets are not integer class labels (the row mask rides
    on them); clients of equal size are stacked as they are, whatever their targets."""
    if any(not isinstance(b, tuple | list) for b in batches):
        raise Unmaskable("full gradients stack in-memory batches (tuples of tensors) only")
    width = max(len(b[-1]) for b in batches)
    if any(len(b[-1]) != width and (b[-1].is_floating_point() or b[-1].dim() != 1) for b in batches):
        raise Unmaskable("full gradients over clients of unequal size pad rows, whose mask rides on integer class targets; these are not")

    def padded(b: tuple[Tensor, ...]) -> list[Tensor]:
        extra = width - len(b[-1])
        if not extra:
            return list(b)
        *inputs, target = b
        return [*(torch.cat([x, x[:1].expand(extra, *x.shape[1:])]) for x in inputs), torch.cat([target, target.new_full((extra,), IGNORE_TARGET)])]

    return tuple(torch.stack(parts) for parts in zip(*(padded(b) for b in batches)))

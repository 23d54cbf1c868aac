"""A round's client results as columns: what a batched round returns, and what the module's round reads.

``RoundResults`` is a ``Sequence[ClientResult]`` for every reader that takes one client at a time (an attack,
message stages, DDP's exchange, tests). A stacked round builds it from columns: ``[S]`` lists of the clients'
ids, local steps, losses and accuracies, and the uploads and new client states as stacked ``[S, ...]`` tensors.
The module's round reads the columns (the loss checks, aggregation, the store's write-back, the round's
metrics), so a stacked round makes no object per client. A client's ``ClientResult`` (views of the stacked
rows) is made only when something reads one; from then on those rows are the results, since a reader may
replace a row's upload, and every column is read from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import ClientResult, Payload


class StackedPayloads(Sequence):
    """``size`` payloads (the clients' uploads) held as one payload of stacked ``[size, ...]`` tensors; upload
    ``i`` (its rows: views, ``P.unstack_rows``) is made only where a reader indexes it."""

    def __init__(self, stacked: Payload, size: int) -> None:
        self.stacked, self._size, self._rows = stacked, size, None

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if self._rows is None:
            parts = {name: self.part(name) for name in self.stacked}
            self._rows = [{name: rows[i] for name, rows in parts.items()} for i in range(self._size)]
        return self._rows[index]

    def part(self, name: str, default: TensorDict | None = None) -> P.StackedDicts:
        """Part ``name`` of every upload (``P.part``), still stacked."""
        if name not in self.stacked and default is None:
            raise KeyError(name)
        return P.StackedDicts(self.stacked.get(name, {}), self._size)

    def row_bytes(self) -> int:
        """The bytes of one upload's tensors (every row holds the same shapes and dtypes)."""
        return sum([t.nbytes for td in self.stacked.values() for t in td.values()]) // max(self._size, 1)


@dataclass
class _Columns:
    client_ids: list[int]
    num_steps: list[int]
    mean_losses: list[float]
    accuracies: list[float]
    uploads: StackedPayloads
    client_states: NestedState  # stacked [S, ...]
    loss_terms: dict[str, list[float]]


class RoundResults(Sequence):
    """The round's client results in task order: columns (``stacked``) or one ``ClientResult`` per client (``of``)."""

    def __init__(self, rows: list[ClientResult] | None = None, columns: _Columns | None = None) -> None:
        self._rows, self._columns = rows, columns

    @classmethod
    def of(cls, results: Sequence[ClientResult]) -> RoundResults:
        """``results`` as ``RoundResults`` (a list of ``ClientResult`` becomes its rows)."""
        return results if isinstance(results, RoundResults) else cls(rows=list(results))

    @classmethod
    def stacked(
        cls, client_ids: list[int], num_steps: list[int], mean_losses: list[float], accuracies: list[float],
        uploads: Payload, client_states: NestedState, loss_terms: Mapping[str, list[float]] | None = None,
    ) -> RoundResults:
        """Results from columns: ``uploads`` and ``client_states`` hold every client's tensors stacked ``[S, ...]``
        (row i: client ``client_ids[i]``); ``loss_terms`` each named loss term's per-client means ({}: none)."""
        size = len(client_ids)
        return cls(columns=_Columns(
            list(client_ids), list(num_steps), list(mean_losses), list(accuracies), StackedPayloads(uploads, size),
            client_states, dict(loss_terms or {}),
        ))  # fmt: skip

    # ---- one client at a time --------------------------------------------------------------------
    @property
    def rows(self) -> list[ClientResult]:
        """One ``ClientResult`` per client (made once, from the columns; from then on the results)."""
        if self._rows is None:
            c, size = self._columns, len(self._columns.client_ids)
            states = unstacked(c.client_states, size)
            terms = [{k: v[i] for k, v in c.loss_terms.items()} for i in range(size)]
            self._rows = [
                ClientResult(cid, c.uploads[i], states[i], c.num_steps[i], c.mean_losses[i], c.accuracies[i], terms[i])
                for i, cid in enumerate(c.client_ids)
            ]
            self._columns = None
        return self._rows

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._columns.client_ids)

    def __getitem__(self, index):
        return self.rows[index]

    def __iter__(self):
        return iter(self.rows)

    # ---- columns ---------------------------------------------------------------------------------
    @property
    def client_ids(self) -> list[int]:
        return self._columns.client_ids if self._rows is None else [r.client_id for r in self._rows]

    @property
    def num_steps(self) -> list[int]:
        return self._columns.num_steps if self._rows is None else [r.num_steps for r in self._rows]

    @property
    def mean_losses(self) -> list[float]:
        return self._columns.mean_losses if self._rows is None else [r.mean_loss for r in self._rows]

    @property
    def accuracies(self) -> list[float]:
        return self._columns.accuracies if self._rows is None else [r.accuracy for r in self._rows]

    @property
    def uploads(self) -> Sequence[Payload]:
        """Every client's upload (``StackedPayloads`` while the results are columns)."""
        return self._columns.uploads if self._rows is None else [r.upload for r in self._rows]

    @property
    def upload_bytes(self) -> list[int]:
        """Each upload's size: its encoded size where message stages set one, else the bytes of its tensors."""
        if self._rows is None:
            return [self._columns.uploads.row_bytes()] * len(self)
        return [r.sent_bytes for r in self._rows]

    @property
    def stacked_states(self) -> NestedState | None:
        """The new client states stacked ``[S, ...]`` (row i: ``client_ids[i]``'s), or None once there are rows."""
        return self._columns.client_states if self._rows is None else None

    @property
    def loss_terms(self) -> dict[str, list[float]]:
        """Each named term of the local loss: its per-client means, over the clients that have named terms."""
        if self._rows is None:
            return self._columns.loss_terms
        named = [r.loss_terms for r in self._rows if r.loss_terms]
        return {k: [t[k] for t in named] for k in named[0]} if named else {}


def merged(parts: Sequence[tuple[Sequence[int], RoundResults]], size: int) -> RoundResults:
    """One round's results from its stacks' (``positions`` in task order, results): columns where every stack
    holds columns of the same tensors (one concatenation and one reordering per tensor), else rows."""
    if len(parts) == 1 and list(parts[0][0]) == list(range(size)):
        return parts[0][1]
    columns = [r._columns for _, r in parts if r._rows is None]
    if len(columns) == len(parts) and all(
        same_tensors(columns[0].uploads.stacked, c.uploads.stacked, 1) and same_tensors(columns[0].client_states, c.client_states, 1)
        and c.loss_terms.keys() == columns[0].loss_terms.keys()
        for c in columns[1:]
    ):
        order = torch.empty(size, dtype=torch.int64)
        order[torch.tensor([p for positions, _ in parts for p in positions], dtype=torch.int64)] = torch.arange(size)

        def tasks_order(trees: list[NestedState]) -> NestedState:
            return {n: {k: torch.cat([t[n][k] for t in trees]).index_select(0, order.to(trees[0][n][k].device)) for k in td} for n, td in trees[0].items()}

        def listed(values: list[list]) -> list:
            flat = [v for column in values for v in column]
            return [flat[i] for i in order.tolist()]

        return RoundResults.stacked(
            listed([c.client_ids for c in columns]), listed([c.num_steps for c in columns]),
            listed([c.mean_losses for c in columns]), listed([c.accuracies for c in columns]),
            tasks_order([c.uploads.stacked for c in columns]), tasks_order([c.client_states for c in columns]),
            {k: listed([c.loss_terms[k] for c in columns]) for k in columns[0].loss_terms},
        )  # fmt: skip
    rows: list[ClientResult | None] = [None] * size
    for positions, results in parts:
        for p, result in zip(positions, results):
            rows[p] = result
    return RoundResults.of(rows)


def same_tensors(a: NestedState, b: NestedState, from_dim: int = 0) -> bool:
    """Whether two-level trees of tensors hold the same tensors: names, dtypes, devices, and shapes from dimension
    ``from_dim`` on (1: stacked trees of any number of clients)."""
    if a.keys() != b.keys():
        return False
    for name, td in a.items():
        other = b[name]
        if td.keys() != other.keys():
            return False
        for k, t in td.items():
            o = other[k]
            if not isinstance(o, torch.Tensor) or t.shape[from_dim:] != o.shape[from_dim:] or t.dtype != o.dtype or t.device != o.device:
                return False
    return True


def unstacked(tree, size: int) -> list:
    """Each client's tree of a stacked one (nested dicts of ``[S, ...]`` tensors): views, one ``unbind`` per tensor."""
    if isinstance(tree, dict):
        per_key = {k: unstacked(v, size) for k, v in tree.items()}
        return [{k: parts[i] for k, parts in per_key.items()} for i in range(size)]
    return list(tree.unbind(0))

"""The client-data contract: everything the engine reads from a federated dataset.

``datamodules.FederatedDataModule`` implements it; an executor, the module and the
callbacks read nothing else from data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

IGNORE_TARGET = -100
"""The target of a padded row (cross-entropy's default ``ignore_index``): it adds nothing to the loss, its
gradient or the accuracy, and the loss is the mean over the real rows (masked stacking)."""


def batch_targets(batch: Any) -> Tensor:
    """A batch's targets: ``labels`` of a dict batch (text), else its last tensor."""
    return batch["labels"] if isinstance(batch, dict) else batch[-1]


class Unstackable(Exception):
    """Clients' batches cannot be stacked on a leading dimension (the message says why)."""


@dataclass
class PaddedBatches:
    """Clients' batches padded to ``steps`` steps of ``rows`` rows each (masked stacking, docs/performance.md).

    ``batches`` yields step k's ``[S, rows, ...]`` batch (padded rows' targets ``IGNORE_TARGET``);
    ``step_mask`` (bool ``[S, steps]``) is False at a client's padded steps, which change nothing;
    ``real_rows`` (int64 ``[S, steps]``) holds each step's real rows (0 at a padded step).
    ``leading`` (optional), called with ``clients[k]`` for each step, yields the same batches with step k's cut
    to its first ``clients[k]`` clients, never gathering the others' rows: a stack of clients in decreasing K
    that shrinks as they finish (``fl_lightning.executors.masking.stack_sizes``) reads only those. Each call
    draws afresh (``batches`` is one iteration); None where the data cuts nothing.
    """

    batches: Iterator[Any]
    step_mask: Tensor
    real_rows: Tensor
    steps: int
    rows: int
    leading: Callable[[Sequence[int]], Iterator[Any]] | None = None


@runtime_checkable
class ClientData(Protocol):
    num_clients: int
    client_sizes: Tensor  # int64 [N]: training samples per client
    seed: int  # the federation's seed: partition, sampling and client randomness derive from it

    def num_local_steps(self, client_id: int, batch_size: int | None, steps: int | None, epochs: int | None) -> int:
        """K for this client: ``steps``, or ``epochs`` passes of ``batch_size`` batches."""

    def client_batches(
        self, client_id: int, seed: int, batch_size: int | None, steps: int | None = None, epochs: int | None = None
    ) -> Iterator[Any]:
        """The client's minibatches for one round, shuffled (and augmented) by ``seed``."""

    def client_full_batch(self, client_id: int) -> Any:
        """All of the client's training data as one batch."""

    # Optional (not part of the structural check): ``client_label_counts(client_id) -> Tensor``, the
    # client's training samples per class (int64 ``[num_classes]``), read by algorithms that declare
    # ``needs_label_counts`` (FedLC, FedRS). Checked before training where an algorithm needs it.

    def stacked_client_batches(
        self, client_ids: Sequence[int], seeds: Sequence[int], batch_size: int | None, steps: int
    ) -> Iterator[Any]:
        """Step k's batches of all the clients stacked ``[S, B, ...]`` (the same samples as
        ``client_batches``); raises ``Unstackable`` before yielding if they cannot be stacked."""

    # Optional (sequential execution): ``round_client_batches(client_ids, seeds, batch_size, steps, epochs, num_steps)
    # -> list[Iterator] | None``, each client's ``client_batches`` (its first ``num_steps[i]``) from one draw for the
    # round's clients; None where the data draws client by client.

    # Optional (masked stacking): ``padded_client_batches(client_ids, seeds, batch_size, steps, epochs, num_steps,
    # bucket=None) -> PaddedBatches``, the batches of ``client_batches`` (client i's first ``num_steps[i]``) padded
    # to the round's largest K and B (``bucket`` rounds both up); raises ``Unstackable`` if they cannot be padded.

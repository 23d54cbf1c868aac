"""Simulated client faults and divergence checks.

A selected client may drop out (never reports), straggle (completes only part of
its local steps) or fail. Every fault is drawn from the client's round seed, so a
run with faults is as reproducible, and as resumable, as one without.

Only declared failures are client faults: ``ClientFailure`` (raise it to simulate a
crashed client) and the transient errors in ``TRANSIENT_ERRORS``. Any other error a
client raises (a shape, dtype or index error, a memory or storage error) would recur
on every client: it stops the run at once (``FatalClientError``), it is never
"left out of the round".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.core.errors import FLError, one_line
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import derive_seed, derive_seeds
from fl_lightning.core.round_results import StackedPayloads

_FAULT_STREAM = 0xFA17


class DivergenceError(FLError, RuntimeError):
    """A client's loss or update, or the global model, became NaN or Inf."""


class ClientError(FLError, RuntimeError):
    """Clients failed: one while ``fail_fast`` is set, too many in a round, or all of a run's."""


class FatalClientError(ClientError):
    """A client raised an error that is not a client fault (it would recur on every client)."""


class ClientFailure(Exception):
    """A declared client failure: raise it (from a client rule, a data hook or a fault
    simulation) to make the client count as failed for this round."""


TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ClientFailure, TimeoutError, ConnectionError)
"""Errors that count as a client failure; every other error a client raises stops the run."""


def fatal_client_error(round_idx: int, client_id: int, error: BaseException) -> FatalClientError:
    """The one-line error for a non-fault raised while client ``client_id`` trained, with a hint by kind."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        hint = "out of memory: reduce local.batch_size, local.steps or the model size"
    elif isinstance(error, OSError) or type(error).__name__ == "SafetensorsError":
        hint = "a storage error: check the client store's directory (disk space, permissions, damaged files)"
    else:
        hint = "check the model against the data (e.g. in_channels, num_classes) and the algorithm's settings"
    return FatalClientError(
        f"round {round_idx}: client {client_id} raised {one_line(error)} -- not a client fault "
        f"(it would recur on every client), so the run stops; {hint}"
    )


@dataclass
class ClientFaults:
    """Failures injected into the round's selected clients.

    Args:
        dropout: probability in [0, 1) that a selected client never reports.
        straggler: probability in [0, 1] that a client completes only part of its local steps.
        straggler_min_fraction: a straggler completes a uniform fraction in
            [straggler_min_fraction, 1) of its steps (at least one step); in (0, 1].
        fail_fast: stop the run when a client fails (``ClientFailure`` or a transient
            error); otherwise the client is left out of that round's aggregate (weights
            renormalised, its state untouched). Other errors always stop the run.
        max_failed_fraction: in [0, 1]; the run stops when more than this fraction of a
            round's training clients fail.
        max_loss_growth: > 1, or None; the run stops (a DivergenceError) when a round's mean
            training loss exceeds this multiple of the first round's. Without it, a loss 100x
            the first round's is reported once as a warning.
    """

    dropout: float = 0.0
    straggler: float = 0.0
    straggler_min_fraction: float = 0.1
    fail_fast: bool = False
    max_failed_fraction: float = 0.5
    max_loss_growth: float | None = None

    def __post_init__(self) -> None:
        if self.max_loss_growth is not None and not self.max_loss_growth > 1.0:  # NaN fails too
            raise ValueError(f"faults.max_loss_growth must be > 1 (a multiple of the first round's loss) or null, got {self.max_loss_growth}")
        if not 0.0 <= self.max_failed_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"faults.max_failed_fraction must be in [0, 1], got {self.max_failed_fraction}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"faults.dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.straggler <= 1.0:
            raise ValueError(f"faults.straggler must be in [0, 1], got {self.straggler}")
        if not 0.0 < self.straggler_min_fraction <= 1.0:
            raise ValueError(f"faults.straggler_min_fraction must be in (0, 1], got {self.straggler_min_fraction}")

    def check_failures(self, round_idx: int, failed: int, trained: int) -> None:
        """Stop the run when more than ``max_failed_fraction`` of the round's ``trained`` clients failed."""
        if trained and failed > self.max_failed_fraction * trained:
            raise ClientError(
                f"round {round_idx}: {failed} of {trained} clients failed, more than faults.max_failed_fraction = "
                f"{self.max_failed_fraction}; see the warnings above for their errors (a value closer to 1 tolerates more)"
            )

    @property
    def active(self) -> bool:
        return self.dropout > 0 or self.straggler > 0

    def draw(self, client_seed: int, num_steps: int) -> tuple[bool, int]:
        """``(dropped, steps to run)`` for one client in one round (drawn in float64 whatever the default
        dtype: the same seed gives the same faults in a float32 and a float64 run)."""
        u = torch.rand(3, generator=torch.Generator().manual_seed(derive_seed(client_seed, _FAULT_STREAM)), dtype=torch.float64).tolist()
        return self._outcome(u, num_steps)

    def draws(self, client_seeds: Sequence[int], num_steps: Sequence[int]) -> list[tuple[bool, int]]:
        """``draw`` of every client of a round, the same values: the generator seeds derived together
        (``derive_seeds``) and one generator reseeded client by client, not one built per client."""
        generator = torch.Generator()
        seeds = derive_seeds(list(client_seeds), _FAULT_STREAM).tolist()
        return [self._outcome(torch.rand(3, generator=generator.manual_seed(s), dtype=torch.float64).tolist(), k) for s, k in zip(seeds, num_steps)]

    def _outcome(self, u: list[float], num_steps: int) -> tuple[bool, int]:
        """``(dropped, steps to run)`` from a client's three uniform draws."""
        if u[0] < self.dropout:
            return True, 0
        if u[1] < self.straggler:
            fraction = self.straggler_min_fraction + (1 - self.straggler_min_fraction) * u[2]
            return False, max(1, min(num_steps, math.floor(fraction * num_steps)))
        return False, num_steps


def survivor_weights(selected: Tensor, weights: Tensor, reported: Sequence[int]) -> Tensor:
    """The plan weights of the ``reported`` clients (of ``selected``), rescaled to the selected set's total."""
    weight_of = dict(zip(selected.tolist(), weights.tolist()))
    survivors = torch.tensor([weight_of[c] for c in reported], dtype=torch.float64)
    if len(reported) < len(selected) and float(survivors.sum()) > 0:
        survivors = survivors * (float(weights.sum()) / float(survivors.sum()))
    return survivors


def first_non_finite(tensors: dict[str, TensorDict]) -> str | None:
    """Name (``"payload/param"``) of the first tensor holding a NaN or Inf, else None."""
    for part, td in tensors.items():
        for name, t in td.items():
            if not is_finite(t):
                return f"{part}/{name}"
    return None


def all_finite(payloads: Sequence[dict[str, TensorDict]]) -> bool:
    """Whether every tensor of every payload is finite, with few ops for many clients
    (payloads may differ in their parts, e.g. a tracking upload from some clients only).

    The per-tensor scan of ``first_non_finite`` then only runs to name a culprit.
    """
    if isinstance(payloads, StackedPayloads):  # a stacked round's uploads: each stacked tensor once
        return all(is_finite(t) for td in payloads.stacked.values() for t in td.values())
    return all(is_finite(t) for name, tds in _by_tensor(payloads) for t in P.across(tds, name))


def _by_tensor(payloads: Sequence[dict[str, TensorDict]]) -> list[tuple[str, list[TensorDict]]]:
    """``(name, the tensor dicts holding it)`` for every (part, name) of the payloads, in first-seen order.
    Where every payload has the first one's parts and names (uploads of one rule: the common case), the
    groups are read off the first payload, without a dictionary update per client and tensor."""
    first = payloads[0] if payloads else {}
    parts = {part: [payload.get(part) for payload in payloads] for part in first}
    if all(payload.keys() == first.keys() for payload in payloads) and all(
        all(td.keys() == first[part].keys() for td in tds) for part, tds in parts.items()
    ):
        return [(name, tds) for part, tds in parts.items() for name in first[part]]
    groups: dict[tuple[str, str], list[TensorDict]] = {}
    for payload in payloads:
        for part, td in payload.items():
            for name in td:
                groups.setdefault((part, name), []).append(td)
    return [(name, tds) for (_, name), tds in groups.items()]


def is_finite(tensor: Tensor) -> bool:
    """No NaN or Inf in ``tensor``.

    A NaN or Inf makes the sum non-finite, so one fast reduction clears the common
    case (``isfinite(t).all()`` is ~20x slower on CPU); only a non-finite sum, which
    finite values can also give by overflowing, is checked exactly: min and max
    are finite (NaN propagates through both).
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    if math.isfinite(float(tensor.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())

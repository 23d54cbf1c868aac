"""Round metrics: local consistency and communication volume."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict

Payload = dict[str, TensorDict]


def local_consistency(deltas: Sequence[TensorDict]) -> float:
    """(1/S) sum_i ||x_i - xbar||^2 with xbar the mean client model (FedMIM paper, Fig. 2b).

    Computed from the uploads delta_i = x_i - x, since x_i - xbar = delta_i - mean(delta);
    small tensors of all clients are stacked (a metric of every round: few ops, not S per tensor).
    """
    if not deltas:
        return 0.0
    total = 0.0  # float64, as a Python float: the same sums and quotient as a float64 tensor, fewer ops
    for name in P.names(deltas):
        parts = P.across(deltas, name)
        if len(parts) == 1 and len(deltas) > 1:
            spread = (parts[0] - parts[0].mean(0)).reshape(-1)
            total += float(torch.dot(spread, spread))
        else:
            centre = sum(t.double() for t in parts) / len(parts)
            total += float(sum((t.double() - centre).square().sum() for t in parts))
    return total / len(deltas)


def consistency_from_sums(delta_sum: TensorDict, delta_sq_sum: float, count: int) -> float:
    """``local_consistency`` from sums over the clients (DDP adds them up across processes):
    (1/S) sum_i ||delta_i||^2 - ||(1/S) sum_i delta_i||^2, in float64."""
    if not count:
        return 0.0
    mean_sq = sum(float((t.double() / count).square().sum()) for t in delta_sum.values())
    return max(delta_sq_sum / count - mean_sq, 0.0)


def payload_bytes(payload: Payload) -> int:
    """Bytes of every tensor a message carries (``P.num_bytes`` of them all, in one list: it is read per upload and round)."""
    return sum([t.nbytes for td in payload.values() for t in td.values()])


def count_messages(totals: dict[str, int], broadcast: Payload, uploads: Sequence[Payload]) -> tuple[int, int]:
    """Add a round's messages to ``totals`` (each reporting client downloads the broadcast and sends
    its upload); returns the round's ``(bytes_down, bytes_up)``."""
    return count_message_bytes(totals, broadcast, [payload_bytes(u) for u in uploads])


def count_message_bytes(
    totals: dict[str, int], broadcast: Payload, upload_bytes: Sequence[int], broadcast_bytes: int | None = None
) -> tuple[int, int]:
    """``count_messages`` from each upload's size in bytes (``broadcast_bytes``: the broadcast's encoded
    size, default the bytes of its tensors)."""
    per_client = payload_bytes(broadcast) if broadcast_bytes is None else broadcast_bytes
    bytes_down, bytes_up = per_client * len(upload_bytes), sum(upload_bytes)
    totals["bytes_down"] += bytes_down
    totals["bytes_up"] += bytes_up
    totals["client_uploads"] += len(upload_bytes)
    return bytes_down, bytes_up


def round_metrics(
    round_idx: int,
    local_lr: float,
    losses: Sequence[float],
    uploads: Sequence[Payload],
    broadcast: Payload,
    totals: dict[str, int],
    accuracies: Sequence[float] = (),
    *,
    upload_bytes: Sequence[int] | None = None,
    consistency: float | None = None,
    broadcast_bytes: int | None = None,
) -> dict[str, float]:
    """The logged row of a round (communication counted into ``totals``).

    ``train/acc`` is the mean over clients of the fraction of their training samples predicted right
    during their local steps (each step's first evaluation, before its update; classifiers only).
    ``comm/round_*`` are this round's bytes, ``comm/cumulative_*`` the run's totals so far;
    ``round`` is the round's 0-based index (Lightning's step of the row).
    A round whose uploads were summed (DDP, ``SummedRound``) passes no ``uploads`` but each
    upload's size (``upload_bytes``) and the ``consistency`` (``consistency_from_sums``).
    """
    if upload_bytes is None:
        upload_bytes = [payload_bytes(u) for u in uploads]
    if consistency is None:  # an upload without a model delta (FedProto's prototypes) adds no tensor to it
        consistency = local_consistency(P.part(uploads, "delta", default={}))
    bytes_down, bytes_up = count_message_bytes(totals, broadcast, upload_bytes, broadcast_bytes)
    known = [a for a in accuracies if not math.isnan(a)]
    return {
        "train/loss": sum(losses) / len(losses) if losses else float("nan"),
        **({"train/acc": sum(known) / len(known)} if known else {}),  # classifiers only
        "train/consistency": consistency,
        "train/local_lr": local_lr,
        "train/clients": float(len(upload_bytes)),
        "comm/round_bytes_up": float(bytes_up),
        "comm/round_bytes_down": float(bytes_down),
        "comm/cumulative_bytes": float(totals["bytes_up"] + totals["bytes_down"]),
        "comm/cumulative_client_uploads": float(totals["client_uploads"]),
        "round": float(round_idx),
    }


def loss_term_means(terms: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``train/loss/<term>``: each named term of an algorithm's local loss (``local_loss``), averaged
    over the round's clients as ``train/loss`` is (the terms of a client sum to its loss); ``terms``
    holds each term's values, one per client that has named terms (``RoundResults.loss_terms``)."""
    return {f"train/loss/{k}": sum(values) / len(values) for k, values in terms.items() if values}


def cep_radius(points: Tensor) -> float:
    """Circular error probable: the median distance of points ``[R, d]`` from their mean
    (Rostami & Kia, Sec. VI: the radius around the Monte Carlo mean holding half the runs)."""
    points = torch.as_tensor(points, dtype=torch.float64)
    if points.ndim != 2 or len(points) < 1:
        raise ValueError(f"cep_radius needs points of shape [runs, dim] with runs >= 1, got {tuple(points.shape)}")
    return float(torch.quantile(torch.linalg.vector_norm(points - points.mean(0), dim=1), 0.5))  # mean of the middle two if R is even

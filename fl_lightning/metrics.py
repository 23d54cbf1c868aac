"""Round metrics: local consistency and communication volume."""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning import params as P
from fl_lightning.params import TensorDict

Payload = dict[str, TensorDict]


def local_consistency(deltas: Sequence[TensorDict]) -> float:
    """(1/S) sum_i ||x_i - xbar||^2 with xbar the mean client model (FedMIM paper, Fig. 2b).

    Computed from the uploads delta_i = x_i - x, since x_i - xbar = delta_i - mean(delta).
    """
    if not deltas:
        return 0.0
    centre = P.mean(deltas)
    return float(sum(P.sq_norm(P.sub(d, centre)) for d in deltas) / len(deltas))


def payload_bytes(payload: Payload) -> int:
    """Bytes of every tensor a message carries."""
    return sum(P.num_bytes(td.values()) for td in payload.values())

"""FedMGDA+ (Hu, Wang, Xu, Lin, Li, "Federated Learning Meets Multi-objective Optimization", IEEE TNSE 2022, Alg. 1):
the server steps along the min-norm convex combination of the clients' normalised updates, its weights kept within
epsilon of uniform, a common descent direction that no client's update opposes.

Rule: docs/algorithms.md, section 30, (30.17)-(30.20); epsilon = 0 is FedAvg on the normalised updates, uniform
weights (bitwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.min_norm import min_norm_weights
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedMGDAPlus(FedAvg):
    """Client: FedAvg's local SGD, uploading its update normalised, u_k = d_k / ||d_k|| (30.17; zero stays zero).
    Server: lambda from ``min_norm_weights`` (30.18) and x <- x + eta_g sum_k lambda_k u_k (30.19), eta_g =
    ``global_lr``. The round's aggregation weights are not used: lambda replaces them (its centre is 1/m).

    Args:
        epsilon: how far each lambda_k may move from 1/m, in [0, 1]; 0: FedAvg on the normalised updates with uniform
            weights (30.20), 1: MGDA's min-norm point of the whole simplex.
        global_lr: eta_g, the length of a step along a unit-norm combination (at most eta_g).
    """

    elementwise = False  # the normalisation reads the update's norm
    linear_aggregate = False  # (30.18) reads every update
    upload_entries = ("delta",)  # u_k, shaped like x

    def __init__(self, epsilon: float = 0.1, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not 0 <= epsilon <= 1:
            raise ValueError(f"FedMGDAPlus epsilon must be a number in [0, 1], got {epsilon!r}")
        self.epsilon = float(epsilon)

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        delta = P.sub(params, ctx.broadcast["x"])
        norm = torch.sqrt(P.sq_norm(delta))  # float64
        return {"delta": {k: torch.where(norm > 0, v / norm, 0.0).to(v.dtype) for k, v in delta.items()}}, ctx.client_state  # (30.17)

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        """(30.19): the pseudo-gradient -sum_k lambda_k u_k; at epsilon = 0 FedAvg's aggregate with weights 1/m."""
        m = len(uploads)
        if self.epsilon == 0:
            return Algorithm.aggregate(self, x, uploads, [1.0 / m] * m, server_state, info, local_steps)  # (30.20)
        units = P.part(uploads, "delta")
        rows = torch.stack([torch.cat([u[k].reshape(-1).double() for k in x]) for u in units])
        lam = min_norm_weights((rows @ rows.T).cpu(), self.epsilon)  # an m x m problem: on the CPU
        return P.scale(P.weighted_sum(units, lam), -1.0), server_state


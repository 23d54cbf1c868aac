"""FedFV, federated fair averaging (Wang, Fan, Qi, Wen, Wang, Yu, IJCAI 2021, Alg. 1): before averaging, each client's
update is projected off the updates it conflicts with, the clients with the larger losses last, so theirs prevail.

Rule: docs/algorithms.md, section 30, (30.13)-(30.16).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, Payload, RoundInfo
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.loss_weighted import loss_at_broadcast
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def to_rows(stacked: TensorDict, like: TensorDict) -> Tensor:
    """``[n, *shape]`` tensors as the rows of one ``[n, d]`` float64 matrix (tensors in ``like``'s order)."""
    return torch.cat([stacked[k].reshape(len(stacked[k]), v.numel()).double() for k, v in like.items()], 1)


def from_rows(rows: Tensor, like: TensorDict) -> TensorDict:
    """``[n, d]`` rows back into ``[n, *shape]`` tensors typed like ``like``."""
    parts = rows.split([v.numel() for v in like.values()], dim=1)
    return {k: p.reshape(len(rows), *v.shape).to(v.dtype) for (k, v), p in zip(like.items(), parts)}


def kept_unprojected(order: list[int], alpha: float) -> set[int]:
    """(30.14): the clients whose updates stay as they are, the last m - ceil((m - 1)(1 - alpha)) of ``order``
    (at least one for any alpha > 0, none at 0), as the released code counts them."""
    return set(order[math.ceil((len(order) - 1) * (1 - alpha)) :]) if alpha > 0 else set()


def project_conflicts(grads: Tensor, order: list[int], keep: set[int]) -> Tensor:
    """(30.14): each g_i not kept, projected in turn onto the normal plane of every g_j (j in ``order``, j != i) it
    conflicts with (g_i' . g_j < 0); the g_j are the original updates."""
    projected = grads.clone()
    sq_norms = (grads * grads).sum(1)
    for i in range(len(grads)):
        if i in keep:
            continue
        for j in order:
            dot = grads[j] @ projected[i]
            if j != i and dot < 0:
                projected[i] = projected[i] - grads[j] * (dot / sq_norms[j])
    return projected


class FedFV(FedAvg):
    """Client: FedAvg's local SGD, uploading d_k = w_k - w^t and its loss F_k(w^t) at the broadcast model (a data
    pass, as ``QFFL``) and its id. Server: g_k = -d_k ordered by loss, conflicts projected out (30.14), averaged
    with the round's weights, projected off the conflicting past updates of the last tau rounds (30.15), rescaled
    to the norm of the plain average (30.16); ``global_lr`` multiplies the step (1: the paper's).

    Args:
        alpha: the fraction of the round's clients with the largest losses whose updates are not projected, in
            [0, 1] (the paper's default 0.1; counted as the released code does, see ``kept_unprojected``).
        tau: the rounds of past updates checked for conflicts, an int >= 0 (0: none; 1: the round's own updates).
            The latest update of each client seen in the last tau - 1 rounds is kept in the server state (and the
            checkpoint), at most tau times the clients per round.
        global_lr: the server step's scale.
    """

    elementwise = False  # the upload carries the client's loss from a data pass
    record_level_dp = False
    linear_aggregate = False  # (30.14) reads every update and loss
    upload_entries = ("delta",)

    def __init__(self, alpha: float = 0.1, tau: int = 1, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"FedFV alpha must be a number in [0, 1], got {alpha!r}")
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise ValueError(f"FedFV tau must be an int >= 0, got {tau!r}")
        self.alpha, self.tau = float(alpha), tau

    def server_state_init(self, x: TensorDict) -> NestedState:
        if not self.tau:
            return {}
        return {
            "fedfv_history": {k: v.new_zeros((0, *v.shape)) for k, v in x.items()},  # g_c, the latest of client c
            "fedfv_seen": {"client": torch.zeros(0, dtype=torch.int64), "round": torch.zeros(0, dtype=torch.int64)},
        }

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        upload, state = super().client_finish(params, local, ctx)
        dtype = next(iter(upload["delta"].values())).dtype
        loss = loss_at_broadcast(ctx).reshape(1).to(dtype)  # F_k(w^t), the ordering key of (30.13)
        return {**upload, "loss": {"f": loss}, "client": {"id": torch.as_tensor(ctx.client).reshape(1)}}, state

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        """(30.13)-(30.16) in float64; the pseudo-gradient is g^t (zeros if it vanishes). With alpha = 1 and tau = 0
        nothing is projected and the rescaling is 1: FedAvg's aggregate itself runs (bitwise)."""
        if self.alpha == 1 and not self.tau:
            return super().aggregate(x, uploads, weights, server_state, info, local_steps)
        deltas = [u["delta"] for u in uploads]
        grads = -to_rows({k: torch.stack([d[k] for d in deltas]) for k in x}, x)  # g_k = w^t - w_k
        losses = torch.cat([u["loss"]["f"] for u in uploads]).double().tolist()
        order = sorted(range(len(uploads)), key=lambda i: losses[i])  # (30.13), ties in upload order
        w = torch.as_tensor(weights, dtype=torch.float64).to(grads.device)
        g = w @ project_conflicts(grads, order, kept_unprojected(order, self.alpha))
        if self.tau:
            ids = torch.cat([u["client"]["id"] for u in uploads]).to(torch.int64)
            server_state, past, rounds = self._remember(server_state, grads, ids, info.round, x)
            if info.round >= self.tau:
                g = self._external(g, past, rounds, info.round)
        norm = torch.linalg.vector_norm(g)
        if not norm > 0:
            return {k: torch.zeros_like(v) for k, v in x.items()}, server_state
        g = g * (torch.linalg.vector_norm(w @ grads) / norm)  # (30.16)
        return {k: v[0] for k, v in from_rows(g[None], x).items()}, server_state

    def _external(self, g: Tensor, past: Tensor, rounds: Tensor, t: int) -> Tensor:
        """(30.15): for the rounds t - tau + 1, ..., t, oldest first, g projected off the sum of the kept updates
        of that round that conflict with it."""
        for k in range(self.tau - 1, -1, -1):
            rows = past[rounds == t - k]
            conflicting = rows[rows @ g < 0]
            if len(conflicting):
                g_con = conflicting.sum(0)
                dot = g @ g_con
                if dot < 0:
                    g = g - g_con * (dot / (g_con @ g_con))
        return g

    def _remember(
        self, state: NestedState, grads: Tensor, ids: Tensor, t: int, x: TensorDict
    ) -> tuple[NestedState, Tensor, Tensor]:
        """Each client's latest update with its round, this round's replacing older ones: the updates (30.15) reads
        now, and the new server state holding those the next round can still read (rounds >= t + 2 - tau)."""
        seen = state["fedfv_seen"]
        older = ~torch.isin(seen["client"], ids)
        past = torch.cat([to_rows(state["fedfv_history"], x)[older], grads])
        clients = torch.cat([seen["client"][older], ids])
        rounds = torch.cat([seen["round"][older], torch.full_like(ids, t)])
        keep = rounds >= t + 2 - self.tau
        return {**state, "fedfv_history": from_rows(past[keep], x), "fedfv_seen": {"client": clients[keep], "round": rounds[keep]}}, past, rounds


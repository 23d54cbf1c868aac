"""AFL, agnostic federated learning (Mohri, Sivek, Suresh, ICML 2019): the model minimises the loss of the worst
mixture lambda of the domains, and lambda ascends the domains' losses, by projected gradient ascent (the paper) or
exponentiated gradient (Ro, Chen, Mathews, Mohri, Suresh, Interspeech 2021).

Rule: docs/algorithms.md, section 30, (30.6)-(30.9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, RoundInfo, weighted_sum_or_zeros
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.loss_weighted import loss_at_broadcast
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import Payload

MIXTURES = ("projected", "exponentiated")
DOMAINS = ("clients", "data")


def project_to_simplex(v: Tensor) -> Tensor:
    """The Euclidean projection of ``v`` [D] onto the probability simplex (30.9), by sorting (Duchi, Shalev-Shwartz,
    Singer, Chandra, ICML 2008, Fig. 1): theta from the largest rho with u_rho > (sum_{j<=rho} u_j - 1) / rho."""
    u = torch.sort(v, descending=True).values
    rho = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    theta = (torch.cumsum(u, 0) - 1) / rho
    last = int((u > theta).nonzero().max())  # u_1 > theta_1 always holds, so some index qualifies
    return (v - theta[last]).clamp(min=0)


class AFL(FedAvg):
    """FedAvg's local SGD; the server steps by the updates weighted with lambda of each client's domain (30.7) and
    moves lambda along the domains' losses at the broadcast model (30.8).

    Args:
        mixture: how lambda ascends: ``projected`` (gradient ascent projected onto the simplex, Mohri et al.) or
            ``exponentiated`` (exponentiated gradient, Ro et al.).
        lambda_lr: gamma_lambda, lambda's step size, >= 0 (0: lambda stays uniform).
        domains: ``clients`` (each client its own domain: lambda over the N clients) or ``data`` (the datamodule's
            ``client_domains``, N integers in [0, D), each used).
        global_lr: the server step's scale.

    F_k(w^t) is the client's mean cross-entropy over its training set at the broadcast model (a data pass), as in
    ``QFFL``; the rule needs a classifier. lambda is server state (a checkpoint carries it).
    """

    elementwise = False  # the upload reads the client's loss and its domain's weight
    record_level_dp = False
    linear_aggregate = True  # sums over clients of beta_k d_k, beta_k and the per-domain losses and counts
    upload_entries = ("delta",)  # the mixture entries are numbers and [D] vectors, not shaped like x

    def __init__(self, mixture: str = "projected", lambda_lr: float = 0.1, domains: str = "clients", global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if mixture not in MIXTURES:
            raise ValueError(f"AFL mixture must be one of {', '.join(MIXTURES)}, got {mixture!r}")
        if isinstance(lambda_lr, bool) or not isinstance(lambda_lr, int | float) or not 0 <= lambda_lr < math.inf:
            raise ValueError(f"AFL lambda_lr must be a number >= 0, got {lambda_lr!r}")
        if domains not in DOMAINS:
            raise ValueError(f"AFL domains must be one of {', '.join(DOMAINS)}, got {domains!r}")
        self.mixture, self.lambda_lr, self.domains = mixture, float(lambda_lr), domains
        self._facts: dict[Any, tuple[Tensor, Tensor, Tensor]] = {}

    # ---- the domains (facts of the data, not state) ---------------------------------------------------------
    def bind_data(self, data: Any) -> None:
        sizes = torch.as_tensor(data.client_sizes, dtype=torch.float64)
        n = len(sizes)
        if self.domains == "clients":
            domain = torch.arange(n)
        else:
            labels = getattr(data, "client_domains", None)
            if labels is None:
                raise ValueError(f"AFL domains: data reads {type(data).__name__}.client_domains, which it does not define; use domains: clients")
            domain = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
            count = int(domain.max()) + 1 if len(domain) else 0
            if len(domain) != n or int(domain.min()) < 0 or len(domain.unique()) != count:
                raise ValueError(f"AFL client_domains must hold {n} integers in [0, D), each of 0..D-1 used, got {labels!r}")
        domain_size = torch.zeros(int(domain.max()) + 1, dtype=torch.float64).index_add_(0, domain, sizes)
        self._facts = {torch.device("cpu"): (domain, sizes, domain_size)}

    def _facts_on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(d_k [N], n_k [N], N_d [D]) on ``device``."""
        if not self._facts:
            raise RuntimeError("AFL reads its domains from the data: call bind_data(data) first (FederatedModule does at setup)")
        if device not in self._facts:
            self._facts[device] = tuple(t.to(device) for t in self._facts[torch.device("cpu")])
        return self._facts[device]

    @property
    def num_domains(self) -> int:
        return len(self._facts_on(torch.device("cpu"))[2])

    # ---- rule --------------------------------------------------------------------------------------------
    def server_state_init(self, x: TensorDict) -> NestedState:
        like = next(iter(x.values()))
        d = self.num_domains
        return {"mixture": {"lambda": torch.full((d,), 1.0 / d, dtype=torch.float64, device=like.device)}}  # (30.6)

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, "mixture": server_state["mixture"]}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """(30.7): beta_k (w_bar_k - w^t) and beta_k = lambda_d n_k / N_d; n_k F_k(w^t) and n_k in row d = d_k."""
        delta = P.sub(params, ctx.broadcast["x"])
        lam = ctx.broadcast["mixture"]["lambda"]
        domain, size, domain_size = self._facts_on(lam.device)
        d, n = domain[ctx.client], size[ctx.client]
        beta = lam[d] * n / domain_size[d].clamp(min=1)
        row = (torch.arange(len(lam), device=lam.device) == d).double() * n
        dtype = next(iter(delta.values())).dtype
        mixture = {"weight": beta.reshape(1), "loss": row * loss_at_broadcast(ctx), "count": row}
        return {"delta": P.scale(delta, beta.to(dtype)), "mixture": {k: v.to(dtype) for k, v in mixture.items()}}, ctx.client_state

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        """The sums over clients of each mixture entry and of beta_k d_k (the round's weights w_k are not used:
        lambda replaces them)."""
        like = next(iter(x.values()))
        d = self.num_domains
        mixture = {"weight": like.new_zeros(1), "loss": like.new_zeros(d), "count": like.new_zeros(d)}
        for upload in uploads:
            mixture = {k: v + upload["mixture"][k] for k, v in mixture.items()}
        return {"delta": weighted_sum_or_zeros(P.part(uploads, "delta"), [1.0] * len(uploads), x), "mixture": mixture}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """The pseudo-gradient -sum_k beta_k d_k / sum_k beta_k (30.7) and lambda's step (30.8)."""
        total = float(sums["mixture"]["weight"].sum())
        step = P.scale(sums["delta"], -1.0 / total) if total > 0 else P.zeros_like(x)
        loss, count = sums["mixture"]["loss"].double(), sums["mixture"]["count"].double()
        domain_loss = torch.where(count > 0, loss / count.clamp(min=1e-300), 0.0)  # L_d; 0 for a domain nobody reported
        lam = server_state["mixture"]["lambda"]
        if self.mixture == "projected":
            lam = project_to_simplex(lam + self.lambda_lr * domain_loss)
        else:  # the shift by the largest loss cancels in the normalisation
            lam = lam * torch.exp(self.lambda_lr * (domain_loss - domain_loss.max()))
            lam = lam / lam.sum()
        return step, {"mixture": {"lambda": lam}}

    def metrics(self, server_state: NestedState, info: RoundInfo) -> dict[str, float]:
        lam = server_state["mixture"]["lambda"]
        entropy = -(lam * lam.clamp(min=1e-300).log()).sum()  # 0 log 0 = 0; log D at uniform
        return {"lambda_max": float(lam.max()), "lambda_entropy": float(entropy)}

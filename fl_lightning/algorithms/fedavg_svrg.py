"""FedAvg-SVRG (Rostami & Kia, Algorithm 1): local SVRG with S snapshots x M inner steps.

Server: the FedAvg aggregate with the round plan's weights; with ``BernoulliParticipation``
those are 1/(N p_n^k), which is Alg. 1 line 20:
theta^{k+1} = theta^k + (1/N) sum_{n in A^k} (w_n - theta^k) / p_n^k.

Rule: docs/algorithms.md, section 10, (10.1)-(10.4); M = 1 is gradient descent (E8).
"""

from __future__ import annotations

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.optim import sgd_step, svrg_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedAvgSVRG(Algorithm):
    """Client: for s = 0..S-1, take a snapshot w~ = w and mu~ = full local gradient at w~ (Alg. 1
    lines 9-10); then M steps w <- w - delta (grad_#(w) - grad_#(w~) + mu~) on one minibatch #
    each (lines 12-15). The step delta is the local lr; keep it constant (the default
    ``local.lr_decay = 1``), as the paper does.

    Local step t is inner step m = t mod M of snapshot s = t // M, so ``local.steps`` must be
    S * M; ``local.batch_size = 1`` picks one sample per step as in the paper.

    Args:
        snapshots: S >= 1.
        inner_steps: M >= 1.
        global_lr: server learning rate (1 in the paper).
    """

    def __init__(self, snapshots: int = 5, inner_steps: int = 2, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if snapshots < 1:
            raise ValueError(f"FedAvgSVRG snapshots (S) must be >= 1, got {snapshots}")
        if inner_steps < 1:
            raise ValueError(f"FedAvgSVRG inner_steps (M) must be >= 1, got {inner_steps}")
        self.snapshots, self.inner_steps = snapshots, inner_steps

    def check_local(self, local) -> None:
        """Every client runs S * M steps: ``local.steps`` = S * M, no ``local.epochs`` (K would follow each client's size)."""
        if local.epochs is not None or local.steps != self.snapshots * self.inner_steps:
            given = f"local.epochs={local.epochs}" if local.epochs is not None else f"local.steps={local.steps}"
            raise ValueError(
                f"FedAvgSVRG runs snapshots * inner_steps = {self.snapshots} * {self.inner_steps} = {self.snapshots * self.inner_steps} "
                f"local steps per client, but {given}; set local.steps = {self.snapshots * self.inner_steps} (and no local.epochs)"
            )

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        if ctx.num_steps != self.snapshots * self.inner_steps:
            raise ValueError(
                f"FedAvgSVRG runs snapshots * inner_steps = {self.snapshots} * {self.inner_steps} = "
                f"{self.snapshots * self.inner_steps} local steps, but local training gives client {ctx.client_id} "
                f"{ctx.num_steps}; set local.steps = {self.snapshots * self.inner_steps}"
            )
        return {}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        if ctx.step % self.inner_steps == 0:  # a new snapshot (lines 9-11); the branch is on the step index only
            local = {"snapshot": P.detach_clone(params), "full_grad": ctx.full_grad(params)}
            # w = w~ here, so grad_#(w) - grad_#(w~) = 0 exactly and v = mu~: skip both minibatch gradients.
            return sgd_step(params, local["full_grad"], ctx.lr), local
        _, grad = ctx.grad(params)
        _, snapshot_grad = ctx.grad(local["snapshot"])  # same minibatch: ctx.grad is bound to this step's batch
        return svrg_step(params, grad, snapshot_grad, local["full_grad"], ctx.lr), local

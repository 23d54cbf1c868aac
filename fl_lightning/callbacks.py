"""Lightning callbacks that measure the global model between rounds."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.func import functional_call

from fl_lightning import params as P
from fl_lightning.params import TensorDict


class GlobalCost(Callback):
    """The federated objective f(x) = (1/N) sum_n f_n(x) over every client's training data,
    evaluated after every round (Rostami & Kia, eq. 2; f_n is the client's mean loss plus the
    ``local.weight_decay`` term the clients optimize). Computed in float64.

    Logs ``train/global_cost`` (and ``train/cost_error`` = f(x) - f* with ``optimum=True``) and
    keeps ``history`` = [f(x^0), f(x^1), ...] and ``final_params`` for Monte Carlo studies.

    Args:
        optimum: also compute f* = min f by full-batch L-BFGS in float64 before the first round
            (exact to round-off for convex problems such as least squares).
        lbfgs_steps: outer L-BFGS iterations for f*.
    """

    def __init__(self, optimum: bool = False, lbfgs_steps: int = 5) -> None:
        self.optimum = optimum
        self.lbfgs_steps = lbfgs_steps
        self.history: list[float] = []
        self.optimal_cost: float | None = None
        self.optimal_params: TensorDict | None = None
        self.final_params: TensorDict | None = None

    @staticmethod
    def _batches(trainer: Trainer, pl_module: LightningModule) -> list:
        data = trainer.datamodule
        out = []
        for cid in range(data.num_clients):
            batch = data.client_full_batch(cid)
            out.append(tuple(t.to(pl_module.device, torch.float64 if t.is_floating_point() else t.dtype) for t in batch))
        return out

    @staticmethod
    def cost(pl_module: LightningModule, x: TensorDict, batches: list) -> torch.Tensor:
        model, wd = pl_module.model, pl_module.local.weight_decay
        frozen = {n: p.detach().double() for n, p in model.named_parameters() if n not in x}
        frozen.update({n: b.double() for n, b in model.named_buffers()})
        losses = []
        for *inputs, target in batches:
            out = functional_call(model, {**frozen, **x}, tuple(inputs))
            loss = model.loss(out, target) if hasattr(model, "loss") else torch.nn.functional.cross_entropy(out, target)
            losses.append(loss + 0.5 * wd * P.sq_norm(x) if wd else loss)
        return torch.stack(losses).mean()

    def _x(self, pl_module: LightningModule) -> TensorDict:
        return {n: v.double() for n, v in pl_module.global_params().items()}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._data = self._batches(trainer, pl_module)
        x0 = self._x(pl_module)
        if self.optimum:
            self.optimal_params, self.optimal_cost = self._minimize(pl_module, x0)
        if not self.history:
            self.history.append(float(self.cost(pl_module, x0, self._data)))

    def _minimize(self, pl_module: LightningModule, x0: TensorDict) -> tuple[TensorDict, float]:
        leaves = {n: v.clone().requires_grad_(True) for n, v in x0.items()}
        opt = torch.optim.LBFGS(list(leaves.values()), lr=1, max_iter=100, tolerance_grad=1e-14, tolerance_change=1e-16, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = self.cost(pl_module, leaves, self._data)
            loss.backward()
            return loss

        for _ in range(self.lbfgs_steps):
            opt.step(closure)
        with torch.no_grad():
            return {n: v.detach() for n, v in leaves.items()}, float(self.cost(pl_module, leaves, self._data))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        with torch.no_grad():
            value = float(self.cost(pl_module, self._x(pl_module), self._data))
        self.history.append(value)
        metrics = {"train/global_cost": value}
        if self.optimal_cost is not None:
            metrics["train/cost_error"] = value - self.optimal_cost
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.final_params = P.detach_clone(pl_module.global_params())

"""FedBABU: federated training of the body with the head frozen at its shared random initialisation,
fine-tuning at evaluation (J. Oh, S. Kim, S.-Y. Yun, "FedBABU: Toward Enhanced Representation for
Federated Image Classification", ICLR 2022, Algorithm 1).

Rule: docs/algorithms.md, section 25.8, (25.8.1)-(25.8.3); finetune_steps = 0 is FedAvg with the head frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.base import Algorithm, ClientContext
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step


def head_names(names: Sequence[str], head: Sequence[str] | None) -> list[str]:
    """The head's tensors among ``names``: those matching ``head`` (patterns or module paths), or with ``head``
    None those of the module holding the last tensor (the last layer: SmallCNN's ``classifier.2``, MLP's last
    ``net.<i>``, ResNet's ``fc``)."""
    if head is None:
        owner = list(names)[-1].rpartition(".")[0]
        return [k for k in names if k.rpartition(".")[0] == owner]
    return [k for k in names if P.matches(k, head)]


class FedBABU(Algorithm):
    """Local SGD on the body only (the head keeps the broadcast value, so its delta is exactly 0 and the global
    head never leaves its initialisation); the server averages as FedAvg. At evaluation each client fine-tunes
    the global model for ``finetune_steps`` SGD steps on its training batches (``personalize_step``).

    Args:
        head: glob patterns or module paths of the head's tensors (``[classifier.2]``: SmallCNN's last layer);
            ``None``: the model's last layer (the module of its last tensor).
        finetune: what fine-tuning trains: ``"all"`` (the whole model, the paper's default) or ``"head"``.
        finetune_steps: fine-tuning steps at evaluation, >= 0 (0: predict with the global model).
        finetune_lr: fine-tuning step size, > 0 (``None``: the last round's local lr).
        global_lr: server learning rate.
    """

    elementwise = True

    def __init__(
        self, head: Sequence[str] | None = None, finetune: str = "all", finetune_steps: int = 5,
        finetune_lr: float | None = None, global_lr: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__(global_lr)
        if head is not None and (isinstance(head, str) or not head):
            raise ValueError(f"FedBABU head must be a non-empty list of name patterns (or null: the last layer), got {head!r}")
        if finetune not in ("all", "head"):
            raise ValueError(f"FedBABU finetune must be 'all' or 'head', got {finetune!r}")
        if type(finetune_steps) is not int or finetune_steps < 0:
            raise ValueError(f"FedBABU finetune_steps must be an integer >= 0, got {finetune_steps!r}")
        if finetune_lr is not None and not finetune_lr > 0:
            raise ValueError(f"FedBABU finetune_lr must be > 0 (or null for the local lr), got {finetune_lr}")
        self.head, self.finetune, self.finetune_lr = None if head is None else list(head), finetune, finetune_lr
        self.personalize_steps = finetune_steps

    def client_state_init(self, x: TensorDict) -> NestedState:
        head = head_names(x, self.head)
        if not head or len(head) == len(x):
            raise ValueError(f"FedBABU head {self.head} must match some but not all of the federated tensors {list(x)}, got {head}")
        return {}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        """(25.8.1): x_{i,k+1} = x_{i,k} - eta_l g on the body; the head stays as broadcast."""
        _, grad = ctx.grad(params)
        head = head_names(params, self.head)
        body = sgd_step({k: p for k, p in params.items() if k not in head}, grad, ctx.lr)
        return {k: body.get(k, p) for k, p in params.items()}, local

    def personalize_step(self, params: TensorDict, ctx: ClientContext) -> TensorDict:
        """(25.8.3): one fine-tuning SGD step on the whole model or on the head."""
        _, grad = ctx.grad(params)
        lr = ctx.lr if self.finetune_lr is None else self.finetune_lr
        tuned = params if self.finetune == "all" else {k: params[k] for k in head_names(params, self.head)}
        return {**params, **sgd_step(tuned, grad, lr)}

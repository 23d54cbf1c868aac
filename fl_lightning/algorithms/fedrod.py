"""FedRoD: a generic model trained with the balanced softmax and a personal head on its representation
(H.-Y. Chen, W.-L. Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022, Algorithm 1, the linear personal head; the hypernetwork variant is not here).

Rule: docs/algorithms.md, section 25.9, (25.9.1)-(25.9.4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientContext, LossContext, ModelOutputs, Payload
from fl_lightning.algorithms.fedbabu import head_names
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.optim import sgd_step

ABSENT_COUNT = 1e-8
"""The count a class the client has no samples of enters the balanced softmax with (log: about -18.4)."""
PERSONAL_HEAD = "personal_head:"
"""The prefix of the personal head's tensors in the parameters ``ctx.grad`` differentiates (not the model's names)."""


class FedRoD(Algorithm):
    """Body and generic head (the whole model, shared, FedAvg's server) trained with the balanced softmax
    CE(o + log n_i, y); a personal linear head h_i (client state, zeros at first) trained with
    CE(o.detach() + h_i(z.detach()), y) on the same minibatch, same step. Client i predicts with
    o + h_i(z) = (W_g + W_i) z + (b_g + b_i): the model with head W_g + W_i, b_g + b_i (``personal_model``).

    Args:
        head: glob patterns or module paths of the model's linear head (one weight ``[C, d]``, optionally one
            bias ``[C]``; ``[classifier.2]``: SmallCNN's last layer); ``None``: the model's last layer (the
            module of its last tensor). The personal head has its shapes.
        global_lr: server learning rate.
    """

    elementwise = True
    needs_features = True
    needs_label_counts = True
    local_loss_ignores_padded_rows = True  # its only reduction over the rows is cross-entropy, which ignores padded rows
    upload_entries = ("delta",)  # its client_finish uploads FedAvg's delta of the model only

    def __init__(self, head: Sequence[str] | None = None, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if head is not None and (isinstance(head, str) or not head):
            raise ValueError(f"FedRoD head must be a non-empty list of name patterns (or null: the last layer), got {head!r}")
        self.head = None if head is None else list(head)

    def client_state_init(self, x: TensorDict) -> NestedState:
        """h_i^0 = 0: the personalized model starts as the generic one."""
        names = head_names(x, self.head)
        ranks = sorted(x[k].dim() for k in names)
        if ranks not in ([2], [1, 2]):
            raise ValueError(f"FedRoD head {self.head} must match one linear layer's weight (and bias), got {names}")
        return {"personal_head": {k: x[k].detach().new_zeros(x[k].shape) for k in names}}

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        """(25.9.1) the generic model's balanced softmax; (25.9.2) the personal head's CE on the detached
        representation and generic logits (its tensors are the ``PERSONAL_HEAD`` entries of ``ctx.params``)."""
        log_counts = ctx.label_counts.to(out.logits.dtype).clamp(min=ABSENT_COUNT).log()
        own = [v for k, v in ctx.params.items() if k.startswith(PERSONAL_HEAD)]
        weight = next(v for v in own if v.dim() == 2)
        bias = next((v for v in own if v.dim() == 1), None)
        personal = out.logits.detach() + F.linear(out.features.detach(), weight, bias)
        return {"balanced_ce": F.cross_entropy(out.logits + log_counts, target), "personal_ce": F.cross_entropy(personal, target)}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"head": {PERSONAL_HEAD + k: v for k, v in ctx.client_state["personal_head"].items()}}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        """(25.9.3): one SGD step of both on the same minibatch, each by the gradient of its own term."""
        _, grad = ctx.grad({**params, **local["head"]})
        stepped = sgd_step({**params, **local["head"]}, grad, ctx.lr)
        return {k: stepped[k] for k in params}, {"head": {k: stepped[k] for k in local["head"]}}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        head = {k[len(PERSONAL_HEAD) :]: v for k, v in local["head"].items()}
        return {"delta": P.sub(params, ctx.broadcast["x"])}, {"personal_head": head}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        """(25.9.4): the global model with the head W_g + W_i, b_g + b_i."""
        head = client_state["personal_head"]
        return {**x, **personal, **{k: x[k] + v for k, v in head.items()}}

"""FedProto: federated prototype learning (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, AAAI 2022, Algorithm 1).

Rule: docs/algorithms.md, section 25.10, (25.10.1)-(25.10.5). Clients never average models: each keeps
its whole model as client state, trains it with CE + lambda * (prototype distance), and uploads its
class prototypes (mean representation per class) and class counts; the server averages the prototypes
per class weighted by the counts. The global model x never changes (pseudo-gradient zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, LossContext, ModelOutputs, Payload, RoundInfo
from fl_lightning.core.local_loss import real_rows
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedProto(Algorithm):
    """Each client trains its own model (client state ``model``) with CE + lambda * d(z, C_y), the
    squared distance of each sample's representation to the global prototype of its class (classes
    without one contribute nothing), then uploads its class prototypes and counts; the server state
    ``prototypes`` holds the global prototypes ``value`` [C, d] and the classes' presence ``present`` [C].

    Clients predict with their own model's logits (``personal_model``). The prototypes' shape [C, d] is
    the model's last weight matrix's (a linear head [C, d]) unless ``num_classes`` and ``feature_dim``
    are given.

    Args:
        lam: weight lambda of the prototype term, >= 0 (PFLlib's default 1.0).
        num_classes: C (None: the rows of the model's last weight matrix).
        feature_dim: d, the representation's width (None: the columns of the model's last weight matrix).
    """

    needs_features = True
    local_loss_ignores_padded_rows = True  # the distance over the real rows only
    # Batched execution stacks the local steps; client_finish (with its data pass) runs client by client (not elementwise).
    upload_entries = ()  # prototypes and counts, not shaped like x: no model-update stage applies (privacy, compression)
    linear_aggregate = True  # the sums over clients of counts * prototypes and of counts (upload_sum)

    def __init__(self, lam: float = 1.0, num_classes: int | None = None, feature_dim: int | None = None) -> None:
        super().__init__(global_lr=1.0)
        if not lam >= 0:
            raise ValueError(f"FedProto lam must be >= 0, got {lam}")
        for name, value in (("num_classes", num_classes), ("feature_dim", feature_dim)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"FedProto {name} must be an integer >= 1 (or null: from the model's head), got {value!r}")
        self.lam, self.num_classes, self.feature_dim = lam, num_classes, feature_dim

    # ---- state -------------------------------------------------------------------------------
    def _shape(self, x: TensorDict) -> tuple[int, int]:
        """[C, d]: the settings, else the model's last weight matrix (its linear head)."""
        matrices = [t for t in x.values() if t.dim() == 2]
        if (self.num_classes is None or self.feature_dim is None) and not matrices:
            raise ValueError("FedProto num_classes and feature_dim must be set for a model without a linear head (no 2-D weight)")
        c = self.num_classes if self.num_classes is not None else matrices[-1].shape[0]
        d = self.feature_dim if self.feature_dim is not None else matrices[-1].shape[1]
        return c, d

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"model": P.detach_clone(x)}  # the client's own model, from the initial global model

    def server_state_init(self, x: TensorDict) -> NestedState:
        c, d = self._shape(x)
        like = next(iter(x.values()))
        return {"prototypes": {"value": like.new_zeros(c, d), "present": like.new_zeros(c)}}  # no class has one yet

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, "prototypes": server_state["prototypes"]}

    # ---- client ------------------------------------------------------------------------------
    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        """(25.10.1): CE + lambda (1/(B d)) sum_b present_{y_b} ||z_b - C_{y_b}||^2 (PFLlib's MSE over B x d)."""
        prototypes = ctx.broadcast["prototypes"]
        z = out.features
        _check_shape(prototypes["value"], out.logits, z)
        real = real_rows(target, ctx)  # masked stacking's padded batch: its real rows (a padded row's target is -100)
        classes = target if real is None else target.clamp(min=0)
        present = prototypes["present"][classes].to(z.dtype)
        if real is not None:
            present = present * real
        rows = z.numel() if real is None else real.sum() * z.shape[-1]
        distance = ((z - prototypes["value"][classes]).square() * present[..., None]).sum() / rows
        return {"ce": F.cross_entropy(out.logits, target), "proto": self.lam * distance}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return {"model": ctx.client_state["model"]}  # trained in place of the broadcast x, which stays as it is

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(local["model"])  # the local loss at the client's own model
        return params, {"model": sgd_step(local["model"], grad, ctx.lr)}

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """(25.10.2): the class means of the representation over the whole training set, and the class counts."""
        seen = ctx.data_pass(local["model"])
        c = _check_shape(ctx.broadcast["prototypes"]["value"], seen.logits, seen.features)
        onehot = F.one_hot(seen.target, c).to(seen.features.dtype) * seen.mask[:, None]
        counts = onehot.sum(0)
        value = onehot.T @ seen.features / counts.clamp(min=1)[:, None]  # 0 for a class the client has no sample of
        return {"prototypes": {"value": value, "count": counts}}, {"model": local["model"]}

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        return {**x, **client_state["model"]}  # (25.10.5): the client's own model and its head's logits

    # ---- server ------------------------------------------------------------------------------
    def upload_sum(self, x: TensorDict, uploads, weights, info: RoundInfo) -> Payload:
        """sum_i n_{i,c} C_c^(i) and sum_i n_{i,c} (the aggregation weights w_i are not used: (25.10.3) weighs by counts)."""
        c, d = self._shape(x)
        like = next(iter(x.values()))
        weighted, count = like.new_zeros(c, d), like.new_zeros(c)
        for upload in uploads:
            sent = upload["prototypes"]
            weighted = weighted + sent["count"][:, None] * sent["value"]
            count = count + sent["count"]
        return {"prototypes": {"weighted": weighted, "count": count}}

    def aggregate_sum(self, x, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps) -> tuple[TensorDict, NestedState]:
        """(25.10.3)-(25.10.4): C_c = sum_i n_{i,c} C_c^(i) / N_c for classes with N_c > 0; x unchanged (pseudo-gradient 0)."""
        count = sums["prototypes"]["count"]
        present = (count > 0).to(count.dtype)
        value = sums["prototypes"]["weighted"] / count.clamp(min=1)[:, None]  # stays 0 for an absent class
        return P.zeros_like(x), {"prototypes": {"value": value, "present": present}}

    def metrics(self, server_state: NestedState, info: RoundInfo) -> dict[str, float]:
        return {"classes_with_prototype": float(server_state["prototypes"]["present"].sum())}


def _check_shape(prototypes: Tensor, logits: Tensor, features: Tensor) -> int:
    """C, after checking that the prototypes [C, d] fit the model's logits [.., C] and representation [.., d]."""
    c, d = prototypes.shape[-2:]
    if logits.shape[-1] != c or features.shape[-1] != d:
        raise ValueError(
            f"FedProto prototypes are [{c}, {d}] but the model gives {logits.shape[-1]} classes and {features.shape[-1]} features; "
            "set num_classes and feature_dim to match"
        )
    return c

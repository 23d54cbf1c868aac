"""The server side of a LoRA aggregation: the model's adapted layers, each client's rank, and the round's
fold and new factors (docs/algorithms.md, section 28). ``FederatedModule`` calls it; the method files
hold only their rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fl_lightning.core.participation import derive_seed
from fl_lightning.core.params import TensorDict

from .base import LayerRound, LoRAAggregation, pad_a, pad_b
from .methods import resolve

_SEED_STREAM = 0x10A  # the fresh A of FLoRA's re-initialisation: derive_seed(data seed, round, this)


class LoRAServer:
    """Applies ``method`` to a model that declares ``lora_layers()`` (``models.LoRAClassifier``, ``LoRACausalLM``).

    Args:
        method: the aggregation.
        model: the network (the module's ``model``).
        federated: the federated tensors' names; ``personal``: the personal ones.
    """

    def __init__(self, method: LoRAAggregation, model: nn.Module, federated: Sequence[str], personal: Sequence[str]) -> None:
        setting = f"model.lora_aggregation={method.name}"
        if not callable(getattr(model, "lora_layers", None)):
            raise ValueError(f"{setting} needs a model with LoRA adapters (models.LoRAClassifier, models.LoRACausalLM); {type(model).__name__} has none")
        self.method, self.layers = method, list(model.lora_layers())
        self.params = dict(model.named_parameters())
        self.rank = int(self.params[self.layers[0].a].shape[0])
        if method.rank_choices is not None and max(method.rank_choices) > self.rank:
            raise ValueError(f"model.lora_aggregation ranks must be in [1, {self.rank}] (the model's rank), got {method.rank_choices}")
        b_personal = [layer.b for layer in self.layers if layer.b in personal]
        if method.personal_b and len(b_personal) < len(self.layers):
            raise ValueError(
                f"{setting} keeps each client's B: set model.personal: ['*lora_B*'] with a personalizing algorithm "
                "(FedAvgP, FedSim, FedAlt, ScaffoldP)"
            )
        if b_personal and not method.personal_b:
            raise ValueError(f"{setting} aggregates B, but model.personal holds it; use model.lora_aggregation=share_a")
        if method.needs_clients and any(layer.b not in federated for layer in self.layers):
            raise ValueError(f"{setting} needs B among the federated tensors")

    def describe(self) -> str | None:
        """The method and its rank rule, for the checkpoint's fingerprint (a resume must use the same);
        None for FedIT's ``factors`` at one rank, the same run as no setting."""
        m = self.method
        if m.name == "factors" and not self.heterogeneous:
            return None
        rule = f" ranks {m.ranks}" if m.ranks is not None else f" tiers {m.tiers} seed {m.seed}" if m.tiers is not None else ""
        return m.name + rule

    # ---- heterogeneous ranks ------------------------------------------------------------------
    @property
    def heterogeneous(self) -> bool:
        return self.method.rank_choices is not None and min(self.method.rank_choices) < self.rank

    @property
    def reads_clients(self) -> bool:
        """Whether the server needs every client's upload (not only their sum)."""
        return self.method.needs_clients or self.heterogeneous

    def client_broadcast(self, broadcast: dict, client: int) -> dict:
        """What client ``client`` receives: every entry shaped like x (x, a tracking y, a control variate)
        zero beyond its rank, so that its padded coordinates get zero gradient and zero corrections."""
        if self.client_rank(client) >= self.rank:
            return broadcast
        return {k: (self.client_x(v, client) if isinstance(v, dict) else v) for k, v in broadcast.items()}

    def client_rank(self, client: int) -> int:
        return self.method.rank_of(client, self.rank)

    def client_x(self, x: TensorDict, client: int) -> TensorDict:
        """What client ``client`` receives: ``x`` with its factors zeroed beyond its rank (rows of A, columns of B)."""
        r = self.client_rank(client)
        if r >= self.rank:
            return x
        out = dict(x)
        for layer in self.layers:
            if layer.a in out:
                out[layer.a] = torch.cat([x[layer.a][:r], x[layer.a].new_zeros(self.rank - r, x[layer.a].shape[1])])
            if layer.b in out:
                out[layer.b] = torch.cat([x[layer.b][:, :r], x[layer.b].new_zeros(x[layer.b].shape[0], self.rank - r)], dim=1)
        return out

    def mask_upload(self, upload: dict, client: int) -> dict:
        """The client's upload with its adapter entries zero beyond its rank (what a rank-r_i client sends, padded)."""
        if self.client_rank(client) >= self.rank:
            return upload
        return {k: (self.client_x(v, client) if isinstance(v, dict) else v) for k, v in upload.items()}

    # ---- the round ------------------------------------------------------------------------------
    def finish_round(self, x: TensorDict, deltas: Sequence[TensorDict], clients: Sequence[int], weights: Tensor, seed: int, round_idx: int) -> int:
        """After the server step: fold and set the new factors of every layer from the clients' factors
        ``x_i = client_x(x) + delta_i`` (at their ranks). Returns the bytes of the folded matrices (what
        clients must receive besides the adapter to rebuild the model)."""
        if not self.method.needs_clients or not deltas:
            return 0
        w = weights.to(torch.float64)
        w = w / w.sum()
        generator = torch.Generator().manual_seed(derive_seed(seed, round_idx, _SEED_STREAM))
        ctx = LayerRound(self.rank, generator)
        folded = 0
        with torch.no_grad():
            for layer in self.layers:
                a_x = x[layer.a] if layer.a in x else self.params[layer.a].detach()
                a_i, b_i = [], []
                for delta, client in zip(deltas, clients):
                    r = self.client_rank(client)
                    a_i.append((a_x + delta[layer.a])[:r] if layer.a in delta else a_x[:r])
                    b_i.append((x[layer.b] + delta[layer.b])[:, :r])
                update = self.method.layer(a_i, b_i, w, ctx)
                if update.a is not None:
                    self.params[layer.a].copy_(pad_a(update.a, self.rank))
                if update.b is not None:
                    self.params[layer.b].copy_(pad_b(update.b, self.rank))
                if update.fold is not None:
                    base = self.params[layer.base]
                    fold = layer.scaling * (update.fold.T if layer.fan_in_fan_out else update.fold)
                    base.add_(fold.to(base.dtype))
                    folded += base.numel() * base.element_size()
        return folded


def lora_server(setting, model: nn.Module, federated: Sequence[str], personal: Sequence[str], algorithm) -> LoRAServer | None:
    """The module's LoRA server for ``model.lora_aggregation`` (``None``: none), its settings checked in one line."""
    method = resolve(setting)
    if method is None:
        return None
    server = LoRAServer(method, model, federated, personal)
    setting = f"model.lora_aggregation={method.name}"
    if server.reads_clients and "delta" not in getattr(algorithm, "upload_entries", ()):
        raise ValueError(f"{setting} reads each client's adapter from its upload's delta; {type(algorithm).__name__} uploads no delta")
    return server

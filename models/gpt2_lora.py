"""GPT-2 (or another causal LM) for sequence classification with LoRA adapters (peft).

Only the LoRA adapters and the classification head ``score`` are trainable, so
they are the federated tensors; the base model is frozen and one copy of it
serves every simulated client (the engine substitutes the adapter tensors with
``torch.func.functional_call``).

FedIT (Zhang et al. 2024) averages the factors A and B separately. Since
``mean(B_i) mean(A_i) != mean(B_i A_i)``, the aggregated low-rank update is not
the mean of the clients' updates. ``freeze_a=True`` keeps A at its (shared,
random) initialisation and trains B only; the update ``B A`` is then linear in
the federated tensors and averaging is exact: ``mean(B_i) A = mean(B_i A)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

_CONV1D_MODEL_TYPES = ("gpt2",)  # transformers' GPT-2 uses Conv1D (weights stored as [in, out])


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """``[B, T]`` padding mask -> the ``[B, 1, T, T]`` boolean mask of a causal LM (True: attend).

    transformers builds the same mask itself from a 2D one, but first reads the padding mask on
    the host (to skip the mask when nothing is padded), a device sync in every forward; an
    already built 4D mask is used as it is.
    """
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    return causal & attention_mask.bool()[:, None, None, :]


def prepared_mask(net: nn.Module, attention_mask: Tensor | None) -> Tensor | None:
    """The mask ``net`` gets: the built 4D causal+padding mask for SDPA attention (no host read of
    the padding, see ``causal_padding_mask``), otherwise ``attention_mask`` as it is."""
    if attention_mask is not None and attention_mask.dim() == 2 and net.config._attn_implementation == "sdpa":
        return causal_padding_mask(attention_mask)
    return attention_mask


def peft_lora_model(
    owner: str, auto_class_name: str, task_type: str, model_name_or_path: str, rank: int, alpha: float, dropout: float,
    target_modules: list[str] | None, fan_in_fan_out: bool | None, freeze_a: bool, trust_remote_code: bool, **load_kwargs,
) -> nn.Module:
    """A pretrained ``transformers`` model (``auto_class_name``, e.g. ``AutoModelForCausalLM``) wrapped by peft
    with LoRA adapters, in training mode: the settings checked (one line naming ``owner``'s setting), the
    hub's errors as one line, a pad token where the model has none, ``freeze_a`` applied."""
    if rank < 1:
        raise ValueError(f"{owner} rank must be >= 1, got {rank}")
    if not alpha > 0:
        raise ValueError(f"{owner} alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{owner} dropout must be in [0, 1), got {dropout}")
    import transformers
    from peft import LoraConfig, get_peft_model

    from fl_lightning.core.hub import hub_error, quiet_hub

    quiet_hub()  # no load report of the (expected) new or untied heads, no download bars
    try:
        base = getattr(transformers, auto_class_name).from_pretrained(
            model_name_or_path, trust_remote_code=trust_remote_code, **load_kwargs
        )
    except OSError as error:  # not downloadable (offline, no such repo) and not a local model directory
        raise hub_error(
            "model.model.init_args.model_name_or_path", model_name_or_path, "base model", error,
            "a local directory with config.json and the weights (save_pretrained)",
        ) from error
    if base.config.pad_token_id is None:  # causal LMs have no pad token (the classifier's head finds the last non-pad one)
        eos = base.config.eos_token_id
        base.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    if fan_in_fan_out is None:
        fan_in_fan_out = base.config.model_type in _CONV1D_MODEL_TYPES
    config = LoraConfig(
        task_type=task_type, r=rank, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=target_modules, fan_in_fan_out=fan_in_fan_out,
    )  # fmt: skip
    net = get_peft_model(base, config)
    if freeze_a:
        for name, p in net.named_parameters():
            if ".lora_A." in name:
                p.requires_grad_(False)
    net.train()  # from_pretrained returns eval mode; a freshly built module trains (dropout on)
    return net


def save_adapter(net: nn.Module, path: str | Path, with_base: bool = False) -> None:
    """``net.save_pretrained(path)`` and the base model's config beside it; ``with_base``: also the base model
    with its current frozen weights in ``path/base`` (where a LoRA aggregation folded updates into them,
    docs/algorithms.md 28), named in ``adapter_config.json`` so that ``AutoPeftModel*`` loads that base. A local
    base is named by its absolute path (``AutoPeftModel*`` loads it from any working directory); a hub name as is."""
    path = Path(path)
    config = net.peft_config["default"]
    original = config.base_model_name_or_path
    if original and Path(original).is_dir():  # a local base as typed (relative) loads only from where the run ran
        config.base_model_name_or_path = str(Path(original).resolve())
    if with_base:
        import copy

        copy.deepcopy(net).unload().save_pretrained(str(path / "base"))
        config.base_model_name_or_path = str((path / "base").resolve())
    try:
        net.save_pretrained(str(path))
    finally:
        config.base_model_name_or_path = original
    net.get_base_model().config.save_pretrained(str(path))


def adapter_layers(net: nn.Module, prefix: str = "net") -> list:
    """Every LoRA-adapted layer of the peft model ``net`` (names under ``prefix``): its A and B, its frozen
    weight, its scaling alpha/r and layout (``fl_lightning.core.adapters.AdapterLayer``, for ``fl_lightning.lora``)."""
    from peft.tuners.lora import LoraLayer

    from fl_lightning.core.adapters import AdapterLayer

    return [
        AdapterLayer(
            a=f"{prefix}.{name}.lora_A.default.weight", b=f"{prefix}.{name}.lora_B.default.weight",
            base=f"{prefix}.{name}.base_layer.weight", scaling=float(module.scaling["default"]),
            fan_in_fan_out=bool(module.fan_in_fan_out),
        )  # fmt: skip
        for name, module in net.named_modules()
        if isinstance(module, LoraLayer)
    ]


class LoRAClassifier(nn.Module):
    """A pretrained causal LM with a classification head and LoRA adapters.

    Args:
        model_name_or_path: hub id or local directory of the base model (``"gpt2"``).
        num_labels: classes of the task (must match the datamodule's ``num_classes``).
        rank: LoRA rank r >= 1.
        alpha: LoRA scaling numerator (the update is ``alpha / r * B A``), > 0.
        dropout: dropout on the LoRA input, in [0, 1).
        target_modules: names of the adapted modules; ``None`` uses peft's default
            for the architecture (GPT-2: the fused attention projection ``c_attn``).
        fan_in_fan_out: whether the targets store weights as ``[in, out]``; ``None``
            decides from the architecture (true for GPT-2's ``Conv1D``).
        freeze_a: train only B (A stays at its shared initialisation): exact averaging.
        trust_remote_code: passed to transformers; leave off unless you trust the repository.
    """

    # Every sample's logits depend on that sample alone (no batch statistics) and the adapters and
    # head are nn.Linear layers fed batch-first: batched execution runs all clients' rows through
    # one forward of the shared frozen base (``fl_lightning.core.objective.ClientRows``).
    independent_rows = True

    def __init__(
        self,
        model_name_or_path: str = "gpt2",
        num_labels: int = 2,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.05,
        target_modules: list[str] | None = None,
        fan_in_fan_out: bool | None = None,
        freeze_a: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"LoRAClassifier num_labels must be >= 2, got {num_labels}")
        # task_type SEQ_CLS makes peft keep the head ``score`` trainable and save it with the adapter
        self.net = peft_lora_model(
            "LoRAClassifier", "AutoModelForSequenceClassification", "SEQ_CLS", model_name_or_path, rank, alpha, dropout,
            target_modules, fan_in_fan_out, freeze_a, trust_remote_code, num_labels=num_labels,
        )  # fmt: skip
        self.model_name_or_path = model_name_or_path
        self.num_labels = num_labels

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        attention_mask = prepared_mask(self.net, attention_mask)
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits

    # The representation convention (docs/architecture.md): forward(...) = head(representation(...)) to float
    # tolerance (the head here is applied to the pooled state, forward applies it to every token, then pools).
    def representation(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The hidden state of each sequence's last non-padding token: the one the ``score`` head's logits are read at."""
        classifier = self.net.get_base_model()
        attention_mask = prepared_mask(self.net, attention_mask)
        body = getattr(classifier, classifier.base_model_prefix)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # transformers' pooling: the rightmost token that is not padding
        non_pad = (input_ids != classifier.config.pad_token_id).to(hidden.device, torch.int32)
        last = (torch.arange(input_ids.shape[-1], device=hidden.device, dtype=torch.int32) * non_pad).argmax(-1)
        return hidden[torch.arange(input_ids.shape[0], device=hidden.device), last]

    def head(self, z: Tensor) -> Tensor:
        return self.net.get_base_model().score(z)

    def lora_layers(self) -> list:
        """The adapted layers (``adapter_layers``): what a LoRA aggregation method reads and writes."""
        return adapter_layers(self.net)

    def save_pretrained(self, path: str | Path, with_base: bool = False) -> None:
        """Write the current adapter (and head) in peft's format, for ``PeftModel.from_pretrained``,
        and the base model's config (``config.json``: ``num_labels``, ``pad_token_id``) beside it,
        the settings ``AutoPeftModelForSequenceClassification`` needs to rebuild the classifier;
        ``with_base``: also the (folded) base model, ``save_adapter``."""
        save_adapter(self.net, path, with_base)

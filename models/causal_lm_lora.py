"""A causal language model with LoRA adapters (peft), for federated instruction tuning.

The loss is next-token cross-entropy on the **response tokens only**: the batch's ``labels``
(built by ``datamodules.InstructionDataModule``) hold, at position t, the token that follows
position t when it belongs to the response (or the end-of-text token closing it), and
``IGNORE_INDEX`` elsewhere (prompt tokens, padding), as in FedIT and Alpaca. The loss of a batch
is the mean over its response tokens ((16.3) of docs/algorithms.md).

Only the LoRA adapters are trainable, so they are the federated tensors; one frozen base model
serves every simulated client. Every sample's logits depend on that sample alone and the adapters
are ``nn.Linear`` layers fed batch-first, so batched execution runs the stacked clients' sequences
as rows of one forward of the shared base (``independent_rows``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .gpt2_lora import adapter_layers, peft_lora_model, prepared_mask, save_adapter

IGNORE_INDEX = -100


def response_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the positions whose label is not ``IGNORE_INDEX``.

    Written with elementwise ops and full reductions (no boolean indexing), so that it runs under
    ``vmap`` for stacked clients and never reads a value on the host.
    """
    valid = labels != IGNORE_INDEX
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    count = valid.sum().clamp(min=1)
    return -(picked * valid).sum() / count


class LoRACausalLM(nn.Module):
    """A pretrained ``AutoModelForCausalLM`` with LoRA adapters, trained on response tokens.

    Args:
        model_name_or_path: hub id or local directory of the base model (``"gpt2"``; any causal LM).
        rank: LoRA rank r >= 1.
        alpha: LoRA scaling numerator (the update is ``alpha / r * B A``), > 0.
        dropout: dropout on the LoRA input, in [0, 1).
        target_modules: names of the adapted modules; ``None`` uses peft's default for the
            architecture (GPT-2: ``c_attn``).
        fan_in_fan_out: whether the targets store weights as ``[in, out]``; ``None`` decides from
            the architecture (true for GPT-2's ``Conv1D``).
        freeze_a: train only B (A stays at its shared initialisation): FedAvg of the adapters is
            then the average of the clients' low-rank updates exactly.
        trust_remote_code: passed to transformers; leave off unless you trust the repository.
    """

    independent_rows = True
    #: The outputs are per token: the training records keep no per-sample accuracy, and evaluation
    #: reports token accuracy and loss over the response tokens only.
    token_level = True
    #: ``loss`` is the mean over the tokens whose label is not -100: a row whose labels are all -100 (a
    #: padded row of masked stacking) adds nothing to it or to its gradient, so clients of unequal batches stack.
    loss_ignores_padded_rows = True

    def __init__(
        self,
        model_name_or_path: str = "gpt2",
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.05,
        target_modules: list[str] | None = None,
        fan_in_fan_out: bool | None = None,
        freeze_a: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.net = peft_lora_model(
            "LoRACausalLM", "AutoModelForCausalLM", "CAUSAL_LM", model_name_or_path, rank, alpha, dropout,
            target_modules, fan_in_fan_out, freeze_a, trust_remote_code,
        )  # fmt: skip
        self.model_name_or_path = model_name_or_path

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits of the next token at positions ``0 .. T-2`` (``[B, T-1, V]``), aligned with ``labels``."""
        attention_mask = prepared_mask(self.net, attention_mask)
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]

    def representation(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The last hidden state at positions ``0 .. T-2`` (``[B, T-1, H]``): what the LM head reads."""
        attention_mask = prepared_mask(self.net, attention_mask)
        lm = self.net.get_base_model()
        body = getattr(lm, lm.base_model_prefix)
        return body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]

    def head(self, z: Tensor) -> Tensor:
        return self.net.get_base_model().get_output_embeddings()(z)

    def lora_layers(self) -> list:
        """The adapted layers (``adapter_layers``): what a LoRA aggregation method reads and writes."""
        return adapter_layers(self.net)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the base model takes (GPT-2: ``n_positions``), or ``None`` when its config does not say."""
        config = self.net.get_base_model().config
        for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def check_data(self, datamodule) -> None:
        """Refuse, in one line and before any training, data whose sequences are longer than the model's positions
        (the embedding lookup would fail with an ``IndexError`` in the first client)."""
        longest, positions = int(getattr(datamodule, "longest", 0) or 0), self.max_positions
        if positions is None or longest <= positions:
            return
        max_length = getattr(datamodule, "max_length", None)
        raise ValueError(
            f"data.init_args.max_length={max_length}: the template + example needs up to {longest} tokens, but the model "
            f"{self.model_name_or_path} has {positions} positions; set data.init_args.max_length <= {positions} "
            "(longer examples are cut at the end) or use a model with more positions"
        )

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return response_loss(logits, labels)

    @torch.no_grad()
    def generate(self, tokenizer, prompts: list[str], max_new_tokens: int = 64) -> list[str]:
        """Greedy continuations of ``prompts`` (one at a time: no padding effects), decoded."""
        was_training = self.net.training
        self.net.eval()
        outputs = []
        try:
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(next(self.parameters()).device)
                out = self.net.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    pad_token_id=self.net.config.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )  # fmt: skip
                outputs.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        finally:
            self.net.train(was_training)
        return outputs

    def save_pretrained(self, path: str | Path, with_base: bool = False) -> None:
        """Write the current adapter in peft's format (``AutoPeftModelForCausalLM.from_pretrained``)
        and the base model's config beside it; ``with_base``: also the (folded) base model, ``save_adapter``."""
        save_adapter(self.net, path, with_base)

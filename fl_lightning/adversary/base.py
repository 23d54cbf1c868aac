"""The two kinds of attack (docs/algorithms.md, 26.2): data poisoning of a malicious client's batches and
model poisoning of its upload. Each attack file shows only its rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class RoundView:
    """What an upload attack knows of the round.

    ``reporting``: n, the clients whose uploads reached the attack (benign and malicious); ``malicious``:
    f, the malicious ones among them; ``global_lr``: the algorithm's server learning rate eta (1.0 if it
    has none); ``seeds``: the malicious clients' round seeds (``derive_seed(data.seed, round, client)``),
    in the order of ``craft``'s rows."""

    round: int
    reporting: int
    malicious: int
    global_lr: float = 1.0
    seeds: tuple[int, ...] = ()


class UploadAttack:
    """Model poisoning: replaces the malicious clients' uploads (flat float64 rows) in a round.

    ``needs_benign``: the attack reads the benign uploads of the round (the colluding, omniscient attacker);
    it is skipped, with a warning, in a round with fewer than 2 of them."""

    needs_benign: ClassVar[bool] = False

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        """``[f, d]`` malicious uploads from their own trained uploads ``own`` ``[f, d]`` and the benign
        uploads ``benign`` ``[b, d]`` of the round."""
        raise NotImplementedError


class DataPoisoning:
    """Transforms a malicious client's training batches ``(inputs, labels)``."""

    def check(self, num_classes: int) -> None:
        """Raise ``ValueError`` (one line naming the setting) if the attack cannot run on ``num_classes`` classes."""

    def poison(self, inputs: Tensor, labels: Tensor, num_classes: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """The poisoned batch; ``generator`` is fixed by (data seed, round, client, step)."""
        raise NotImplementedError

    def triggered(self, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor] | None:
        """For a backdoor: the test inputs of non-target classes with the trigger, and the target labels
        (``attack/backdoor_asr``); None for an attack without a trigger."""
        return None


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, labels)`` of a batch, or a one-line ``ValueError``."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1]
    raise ValueError("attack.data poisons (inputs, labels) batches of tensors (e.g. digits, CIFAR); this dataset's batches are not")

"""Record-level DP-SGD in local training (``--model.record_privacy``; docs/privacy.md, "Record-level
DP-SGD"; docs/algorithms.md, equations (RDP.1)-(RDP.2)).

Every local step of every client replaces the minibatch gradient ``ctx.grad`` returns by the
clipped, noised sum of per-example gradients of (RDP.1) (``fl_lightning.executors.dpsgd``); the algorithm's
own step rule consumes it unchanged. ``RecordAccountant`` composes each client's steps and the
round logs ``privacy/record_epsilon`` (the worst client's) and its distribution over clients.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from fl_lightning.core.capabilities import declared
from fl_lightning.pipeline.privacy import check_gaussian_mechanism
from fl_lightning.pipeline.record_accounting import RecordAccountant

RULE_METHODS = ("client_init", "client_step", "local_loss", "client_warmup")
"""The methods ``record_level_dp`` speaks for: the rule's local steps and its local objective."""


def declares_record_level_dp(algorithm: Any) -> bool:
    """Whether the class that wrote the rule declares ``record_level_dp = True``: its local objective is a
    mean of per-example losses that reads nothing of the client's data but the step's batch, and each local
    step evaluates ``ctx.grad`` once (no full or mean gradients, no warm-up pass over the data)."""
    return declared(algorithm, "record_level_dp", RULE_METHODS)


class RecordPrivacy:
    """Record-level DP-SGD settings (``--model.record_privacy``; docs/privacy.md).

    Args:
        clip_norm: C > 0, the L2 bound of each example's gradient (over every trained tensor).
        noise_multiplier: sigma >= 0, the noise std on the step's clipped sum in units of C.
        delta: the delta of the reported (epsilon, delta), in (0, 1).
        sampling: ``"poisson"`` (each record in a step's batch independently with probability q_i; accounted
            under add-or-remove-one record) or ``"fixed"`` (``local.batch_size`` records uniformly without
            replacement; accounted under replace-one record).
        sampling_rate: Poisson only: q in (0, 1], the same for every client (the expected batch size q n_i);
            null: q_i = local.batch_size / n_i (the expected batch size local.batch_size for every client).
        accountant: ``"rdp"`` (Renyi DP at dp-accounting's default orders; integer orders for ``"fixed"``) or
            ``"pld"`` (privacy loss distributions, tighter; Poisson sampling only).
    """

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        delta: float = 1e-5,
        sampling: Literal["poisson", "fixed"] = "poisson",
        sampling_rate: float | None = None,
        accountant: Literal["rdp", "pld"] = "rdp",
    ) -> None:
        check_gaussian_mechanism("record_privacy", clip_norm, noise_multiplier, delta)
        if sampling not in ("poisson", "fixed"):
            raise ValueError(f"record_privacy.sampling must be 'poisson' or 'fixed', got {sampling!r}")
        if sampling_rate is not None and not (isinstance(sampling_rate, (int, float)) and 0 < sampling_rate <= 1):
            raise ValueError(f"record_privacy.sampling_rate must be in (0, 1] (or null), got {sampling_rate}")
        if sampling_rate is not None and sampling != "poisson":
            raise ValueError("record_privacy.sampling_rate applies to sampling='poisson' only; 'fixed' takes local.batch_size records")
        if accountant not in ("rdp", "pld"):
            raise ValueError(f"record_privacy.accountant must be 'rdp' or 'pld', got {accountant!r}")
        if accountant == "pld" and sampling != "poisson":
            raise ValueError("record_privacy.accountant='pld' supports sampling='poisson' only (use accountant='rdp' for 'fixed')")
        self.clip_norm, self.noise_multiplier, self.delta = float(clip_norm), float(noise_multiplier), float(delta)
        self.sampling, self.sampling_rate, self.method = sampling, sampling_rate, accountant
        self.accountant: RecordAccountant | None = None
        self.batch_size = 0
        self.sizes = self.rates = None
        self._restored: torch.Tensor | None = None

    # ---- before training -----------------------------------------------------------------------
    def check(self, algorithm: Any, model: nn.Module, data: Any, local: Any) -> None:
        """Refuse, in one line, what no guarantee can be stated for (docs/privacy.md, "What is refused")."""
        name = type(algorithm).__name__
        if not declares_record_level_dp(algorithm):
            raise ValueError(
                f"record_privacy: {name} does not declare record_level_dp (its local objective must be a mean of "
                "per-example losses reading nothing of the client's data but the step's batch, with one ctx.grad per "
                "local step; docs/privacy.md lists the algorithms that do and why others are refused)"
            )
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError(
                f"record_privacy: {type(model).__name__} has BatchNorm, which mixes the examples of a batch (per-example "
                "gradients are not defined); use GroupNorm or a model without BatchNorm"
            )
        if not callable(getattr(data, "client_records", None)):
            raise ValueError(f"record_privacy: the data {type(data).__name__} defines no client_records(clients, positions); use a FederatedDataModule")
        if getattr(data, "augments_batches", False):
            raise ValueError(f"record_privacy: {type(data).__name__} augments batches, which the DP-SGD sampler does not apply yet")
        if self.sampling_rate is None and local.batch_size is None:
            raise ValueError("record_privacy needs local.batch_size (the expected batch size B) or record_privacy.sampling_rate")

    def prepare(self, data: Any, local: Any) -> None:
        """Each client's sampling rate (checked in (0, 1]) and the accountant (restored from a checkpoint)."""
        sizes = np.asarray(data.client_sizes, dtype=np.int64)
        if self.sampling_rate is not None:
            rates = np.full(len(sizes), float(self.sampling_rate))
        else:
            self.batch_size = int(local.batch_size)
            small = int(np.argmin(sizes))
            if sizes[small] < self.batch_size:
                raise ValueError(
                    f"record_privacy: client {small} holds {sizes[small]} records, fewer than local.batch_size={self.batch_size}: its "
                    f"sampling rate B / n_i would exceed 1 (must be in (0, 1]); lower local.batch_size"
                )
            rates = self.batch_size / sizes
        self.sizes, self.rates = sizes, rates
        self.accountant = RecordAccountant(sizes, rates, self.batch_size, self.noise_multiplier, self.delta, self.sampling, self.method)
        if self._restored is not None:
            self._load_steps(self._restored)

    # ---- during training -----------------------------------------------------------------------
    def denominator(self, client: int) -> float:
        """B_i of (RDP.1): the expected batch size q_i n_i (Poisson) or B (fixed)."""
        if self.sampling == "fixed" or self.sampling_rate is None:
            return float(self.batch_size)
        return float(self.sampling_rate * self.sizes[client])

    def account(self, clients, steps) -> dict[str, float]:
        """The round's local steps accounted; the metrics logged with it."""
        self.accountant.add(clients, steps)
        return self.metrics()

    def metrics(self) -> dict[str, float]:
        return {**self.accountant.metrics(), "privacy/record_noise_multiplier": self.noise_multiplier}

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        steps = self.accountant.steps if self.accountant is not None else np.zeros(0, dtype=np.int64)
        return {
            "steps": torch.from_numpy(steps.copy()), "noise_multiplier": torch.tensor(self.noise_multiplier, dtype=torch.float64),
            "clip_norm": torch.tensor(self.clip_norm, dtype=torch.float64),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key in ("noise_multiplier", "clip_norm"):
            saved = float(state[key])
            if saved != getattr(self, key):
                raise ValueError(
                    f"record_privacy.{key}={getattr(self, key):g} differs from the checkpoint's {saved:g}: the accountant would "
                    "compose steps that did not happen; resume with the settings the run was started with"
                )
        self._restored = state["steps"].clone()
        if self.accountant is not None:
            self._load_steps(self._restored)

    def _load_steps(self, steps: torch.Tensor) -> None:
        if len(steps) != len(self.accountant.steps):
            raise ValueError(f"record_privacy: the checkpoint accounts {len(steps)} clients, this run has {len(self.accountant.steps)}")
        self.accountant.steps = steps.numpy().astype(np.int64).copy()

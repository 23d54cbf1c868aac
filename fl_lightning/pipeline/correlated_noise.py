"""Client-level DP without sampling: DP-FTRL's tree aggregation (Kairouz et al., ICML 2021) and banded
matrix factorization (Choquette-Choo et al., NeurIPS 2023) under a fixed cyclic participation schedule
(docs/privacy.md, "Without sampling"; docs/algorithms.md section 32).

Per round t the cohort's uploads are clipped to C (the client-level DP clip, ``ClipStage``), summed, and the
server adds sigma C w_t, w_t the t-th row of the mechanism's correlated noise (32.2), dividing by the fixed
cohort size D of the schedule:

    sum_i w u_i  ->  (1/D) (sum_i clip_C(u_i) + sigma C w_t)                                    (32.1)

The release of the first t rounds is the Gaussian mechanism C X + sigma C Z of sensitivity C Delta_t
(32.7): epsilon after t rounds is that of one Gaussian query at noise multiplier sigma / Delta_t, by
dp-accounting's RDP accountant, with no amplification by sampling (32.8).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import numpy as np
import torch

from fl_lightning.pipeline.matrix_factorization import BandedNoise, TreeNoise, banded_toeplitz, sensitivities
from fl_lightning.pipeline.privacy import ClipStage, check_gaussian_mechanism

MECHANISMS = ("tree", "tree_efficient", "banded")
CORRELATED_STREAM = 0xDC
"""Seed stream of the mechanism's Gaussian vectors z (within the run's seed, addressed by tree node or round)."""


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Epsilon at ``delta`` of one Gaussian query at ``noise_multiplier`` (noise std / sensitivity), by
    dp-accounting's RDP accountant at its default orders (RDP alpha / (2 sigma^2); Balle et al. 2020's conversion)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    if noise_multiplier == math.inf:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return float(accountant.get_epsilon(delta))


class CorrelatedNoise:
    """Client-level DP with correlated noise across rounds (``--model.privacy``, in place of ``ClientPrivacy``);
    needs ``data.participation: CyclicParticipation`` (docs/privacy.md, "Without sampling").

    Args:
        mechanism: ``"tree"`` (DP-FTRL, the prefix sum's noise from its dyadic tree nodes), ``"tree_efficient"``
            (the same tree read through Honaker's efficient estimator) or ``"banded"`` (banded Toeplitz matrix
            factorization).
        clip_norm: C > 0, the L2 bound of each client's whole upload.
        noise_multiplier: sigma >= 0, the std of each z per unit C.
        delta: the delta of the reported (epsilon, delta), in (0, 1).
        bands: b >= 1 of ``"banded"`` (None: the schedule's separation, the most its sensitivity's closed form
            allows); at most the separation.
        restart: the trees' ``"tree"``/``"tree_efficient"``: a new tree every ``restart`` rounds (Kairouz et al.'s
            restart per epoch: with ``restart`` = the separation, each tree holds one participation of each client;
            None: one tree for the run).
        horizon: the number of rounds T the banded matrix is optimised for (None: ``trainer.max_steps``); a run
            stopped before it resumes to it with the same matrix. Its Toeplitz coefficients serve any number of rounds.
    """

    method = "rdp"
    adaptive_clipping, clipping = False, "flat"  # what ``ClipStage`` reads

    def __init__(
        self,
        mechanism: Literal["tree", "tree_efficient", "banded"] = "banded",
        clip_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        delta: float = 1e-5,
        bands: int | None = None,
        restart: int | None = None,
        horizon: int | None = None,
    ) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"privacy.mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
        check_gaussian_mechanism("privacy", clip_norm, noise_multiplier, delta)
        if bands is not None and (isinstance(bands, bool) or not isinstance(bands, int) or bands < 1):
            raise ValueError(f"privacy.bands must be an integer >= 1 (or null: the participation's separation), got {bands!r}")
        if bands is not None and mechanism != "banded":
            raise ValueError(f"privacy.bands applies to mechanism 'banded' only, got mechanism {mechanism!r}")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ValueError(f"privacy.horizon must be an integer >= 1 (or null: trainer.max_steps), got {horizon!r}")
        if restart is not None and (isinstance(restart, bool) or not isinstance(restart, int) or restart < 1 or mechanism == "banded"):
            raise ValueError(f"privacy.restart must be an integer >= 1 (or null: one tree), for the tree mechanisms only; got {restart!r}")
        self.mechanism, self.bands, self.horizon, self.restart = mechanism, bands, horizon, restart
        self.clip_norm, self.noise_multiplier, self.delta = float(clip_norm), float(noise_multiplier), float(delta)
        self.current_clip = self.clip_norm
        self.coefficients: torch.Tensor | None = None
        self.sensitivity: np.ndarray | None = None  # Delta_t for t = 1..T
        self._stages = [ClipStage(self)]

    def stages(self) -> list:
        """The uplink stages this setting contributes: the clip (client); the noise is the round stage's."""
        return list(self._stages)

    def prepare(self, participation: Any, num_clients: int, rounds: int) -> None:
        """Before training: refuse a schedule the mechanism does not assume, compute C (banded) and Delta_t."""
        from fl_lightning.core.participation import CyclicParticipation

        if not isinstance(participation, CyclicParticipation):
            raise ValueError(
                f"privacy.mechanism={self.mechanism} assumes a fixed schedule with a minimum separation, not sampling: "
                f"data.participation must be CyclicParticipation (groups=1: every round), got {type(participation).__name__}"
            )
        separation = participation.separation
        if self.mechanism == "banded":
            bands = self.bands or separation
            if bands > separation:
                raise ValueError(
                    f"privacy.bands={bands} exceeds CyclicParticipation.groups={separation} (the separation of a client's rounds), "
                    "which banded matrix factorization's sensitivity assumes; lower privacy.bands or raise groups"
                )
            horizon = self.horizon or rounds
            self.coefficients = banded_toeplitz(min(bands, horizon), horizon)
        groups = [participation.rounds_of(g, rounds) for g in range(min(separation, num_clients))]
        c = None if self.coefficients is None else self.coefficients.numpy()
        self.sensitivity = sensitivities("banded" if c is not None else "tree", groups, rounds, c, self.restart)
        self.rounds = rounds

    def noise(self, seed: int, size: int) -> TreeNoise | BandedNoise:
        """The noise's state machine for flat uploads of ``size`` entries; its vectors z drawn from (seed, node),
        on the CPU in float64."""
        from fl_lightning.core.participation import derive_seed

        def draw(height: int, first: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(derive_seed(seed, CORRELATED_STREAM, height, first))
            return torch.randn(size, generator=generator, dtype=torch.float64)

        if self.mechanism == "banded":
            return BandedNoise(draw, self.coefficients)
        return TreeNoise(draw, efficient=self.mechanism == "tree_efficient", period=self.restart)

    def epsilon(self, rounds_done: int) -> float:
        """Epsilon after the first ``rounds_done`` rounds' release (32.8)."""
        if rounds_done == 0:
            return 0.0
        delta_t = float(self.sensitivity[min(rounds_done, len(self.sensitivity)) - 1])
        return gaussian_epsilon(self.noise_multiplier / delta_t if delta_t > 0 else math.inf, self.delta)


"""Client-level differential privacy (DP-FedAvg; McMahan, Ramage, Talwar, Zhang, ICLR 2018) as
message stages any linear-aggregate algorithm runs under (docs/privacy.md, docs/algorithms.md
section "Client-level DP").

Per round: each reporting client's upload u_i (every entry it sends: ``delta``, SCAFFOLD's
``delta_c``, ...) is clipped to L2 norm C (``ClipStage``, on the client), the server adds
Gaussian noise z ~ N(0, sigma^2 C^2 I) to the sum of the clipped uploads, once, and divides by a
fixed denominator D, the expected cohort size (``GaussianSumNoise``):

    sum_i w u_i  ->  (1/D) (sum_i clip_C(u_i) + z),        clip_C(u) = u min(1, C / ||u||)   (DP.1)

fed to the algorithm's ``upload_sum`` as the clients' uploads with weight 1/D plus one
pseudo-upload z with weight 1/D. The accountant (``fl_lightning.pipeline.privacy_accounting``) logs
``privacy/epsilon`` every round.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch

from fl_lightning.algorithms.base import RoundInfo, declares_capability
from fl_lightning.pipeline.messages import CLIP, NOISE, AggregateStage, ClientStage, Sent, StageKey, sends_no_model_shaped_upload, upload_like
from fl_lightning.pipeline.privacy_accounting import ClientAccountant, SamplingScheme, calibrate_noise, epsilon_after
from fl_lightning.core.tasks import Payload

log = logging.getLogger(__name__)
NOISE_STREAM, COUNT_STREAM = 0xD9, 0xDA
"""Seed streams of the Gaussian noise on the sum and on adaptive clipping's count (within the server's round seed)."""


def upload_norm(upload: Payload) -> float:
    """||u||: the L2 norm over every tensor of every entry (float64)."""
    tensors = [t for td in upload.values() for t in td.values()]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])))


def clip(upload: Payload, clip_norm: float, per_entry: bool = False) -> Payload:
    """``upload * min(1, C / ||upload||)``, the norm over every tensor of every entry (flat), or with
    ``per_entry`` each entry clipped to ``C / sqrt(E)`` (E entries) so the whole stays within C."""
    if per_entry:
        bound = clip_norm / math.sqrt(len(upload))
        return {name: clip({name: td}, bound)[name] for name, td in upload.items()}
    tensors = [t for td in upload.values() for t in td.values()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors]))
    factor = torch.clamp(clip_norm / (norm + 1e-12), max=1.0)
    return {name: {k: (v.double() * factor).to(v.dtype) for k, v in td.items()} for name, td in upload.items()}


class ClipStage(ClientStage):
    """clip_C of (DP.1), on the client."""

    order, name = CLIP, "dp_clip"

    def __init__(self, privacy: ClientPrivacy) -> None:
        self.privacy = privacy
        self.unclipped = 0  # this process's clients of the round whose update was within C (adaptive clipping's count)

    def begin_round(self, info: RoundInfo) -> None:
        self.unclipped = 0

    def apply(self, upload: Payload, state, key: StageKey) -> Sent:
        clip_norm = self.privacy.current_clip
        if self.privacy.adaptive_clipping:
            self.unclipped += upload_norm(upload) <= clip_norm
        return Sent(clip(upload, clip_norm, self.privacy.clipping == "per_entry"))


class GaussianSumNoise(AggregateStage):
    """The noise z and the fixed weight 1/D of (DP.1), on the server; accounts each round."""

    order, name = NOISE, "dp_noise"

    def __init__(self, privacy: ClientPrivacy) -> None:
        self.privacy = privacy

    def check(self, algorithm: Any, num_clients: int) -> None:
        name = type(algorithm).__name__
        if not declares_capability(algorithm, "linear_aggregate"):
            raise ValueError(
                f"privacy: {name} cannot run under client-level DP: its aggregate is not declared a weighted sum of the "
                "uploads (linear_aggregate), so the noised sum's guarantee does not carry to it"
            )
        if getattr(algorithm, "warmup_pass", False):
            raise ValueError(f"privacy: {name} cannot run under client-level DP: its warm-up pass uploads every client's state unclipped")
        if sends_no_model_shaped_upload(algorithm):
            raise ValueError(
                f"privacy: {name} cannot run under client-level DP: its uploads are not shaped like the model (its "
                "upload_entries is empty, e.g. FedProto's class prototypes), so clipping and noising model updates do not apply"
            )
        if not upload_like(algorithm, {}):
            raise ValueError(
                f"privacy: {name} cannot run under client-level DP: it does not declare its upload's entries "
                "(upload_entries), so the noise cannot cover every tensor it sends"
            )

    def weight(self, info: RoundInfo) -> float:
        return 1.0 / self.privacy.scheme.expected_cohort(info.round)

    def extra_upload(self, like: Payload, key: StageKey) -> Payload:
        """z ~ N(0, sigma^2 C^2) per coordinate, drawn on the CPU from (seed, round)."""
        std, generator = self.privacy.update_noise * self.privacy.current_clip, key.generator(NOISE_STREAM)
        out = {}
        for name, td in like.items():
            out[name] = {}
            for k, v in td.items():
                z = torch.randn(v.shape, generator=generator, dtype=torch.float64) * std
                out[name][k] = z.to(v.device, v.dtype)
        return out

    def end_round(self, info: RoundInfo, reporting: int) -> dict[str, float]:
        return self.privacy.account(info)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.privacy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.privacy.load_state_dict(state)


def _summed_over_processes(count: int) -> int:
    """Under DDP each process clips its own clients: the round's count is the sum over the processes
    (every process runs the server step, so every one reaches this all_reduce)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return count
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    total = torch.tensor(float(count), dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def check_gaussian_mechanism(setting: str, clip_norm: float, noise_multiplier: float, delta: float) -> None:
    """The settings every clipped Gaussian mechanism here shares, each refused in one line naming ``setting``."""
    if not (isinstance(clip_norm, (int, float)) and clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"{setting}.clip_norm must be > 0 (finite), got {clip_norm}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"{setting}.noise_multiplier must be >= 0 (finite), got {noise_multiplier}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"{setting}.delta must be in (0, 1), got {delta}")


class ClientPrivacy:
    """Client-level DP settings (``--model.privacy``); docs/privacy.md.

    Args:
        clip_norm: C > 0, the L2 bound of each client's whole upload.
        noise_multiplier: sigma >= 0 (noise std / C); ignored with ``target_epsilon`` and
            ``budget="calibrate"``.
        delta: the delta of the reported (epsilon, delta), in (0, 1).
        target_epsilon: an epsilon budget (None: none).
        budget: with ``target_epsilon``: ``"calibrate"`` (sigma chosen before training, by binary search
            through the accountant, so that ``trainer.max_steps`` rounds spend at most the budget) or
            ``"stop"`` (train at ``noise_multiplier`` and stop before the round that would exceed it).
        clipping: ``"flat"`` (one norm over the whole upload) or ``"per_entry"`` (each upload entry,
            e.g. ``delta`` and ``delta_c``, to C / sqrt(entries)).
        accountant: ``"rdp"`` (Renyi DP at dp-accounting's default orders; integer orders under sampling without
            replacement) or ``"pld"`` (privacy loss distributions).
        adaptive_clipping: adapt C each round towards the ``target_quantile`` of the clients' update norms
            (Andrew et al., NeurIPS 2021): C <- C exp(-clip_lr (b~ - target_quantile)), b~ the noised fraction
            of unclipped clients; ``clip_norm`` is the initial C. One process only.
        target_quantile: gamma in (0, 1).
        clip_lr: eta_C > 0.
        count_noise: sigma_b, the std of the noise on the unclipped count (default: expected cohort / 20,
            the paper's); must exceed 1 / (2 noise_multiplier). The update's noise multiplier becomes
            (sigma^-2 - (2 sigma_b)^-2)^-1/2 so that the round's two queries together spend what sigma
            alone would (Andrew et al., Thm 1); the accountant composes both.
    """

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float = 1.0,
        delta: float = 1e-5,
        target_epsilon: float | None = None,
        budget: Literal["calibrate", "stop"] = "calibrate",
        clipping: Literal["flat", "per_entry"] = "flat",
        accountant: Literal["rdp", "pld"] = "rdp",
        adaptive_clipping: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_noise: float | None = None,
    ) -> None:
        check_gaussian_mechanism("privacy", clip_norm, noise_multiplier, delta)
        if target_epsilon is not None and not (target_epsilon > 0 and math.isfinite(target_epsilon)):
            raise ValueError(f"privacy.target_epsilon must be > 0 (or null), got {target_epsilon}")
        if budget not in ("calibrate", "stop"):
            raise ValueError(f"privacy.budget must be 'calibrate' or 'stop', got {budget!r}")
        if clipping not in ("flat", "per_entry"):
            raise ValueError(f"privacy.clipping must be 'flat' or 'per_entry', got {clipping!r}")
        if accountant not in ("rdp", "pld"):
            raise ValueError(f"privacy.accountant must be 'rdp' or 'pld', got {accountant!r}")
        if not 0 < target_quantile < 1:
            raise ValueError(f"privacy.target_quantile must be in (0, 1), got {target_quantile}")
        if not clip_lr > 0:
            raise ValueError(f"privacy.clip_lr must be > 0, got {clip_lr}")
        if count_noise is not None and not count_noise > 0:
            raise ValueError(f"privacy.count_noise must be > 0 (or null), got {count_noise}")
        if adaptive_clipping and noise_multiplier == 0 and target_epsilon is None:
            raise ValueError("privacy.adaptive_clipping needs noise_multiplier > 0 (the count's noise is part of the budget)")
        self.adaptive_clipping, self.target_quantile = adaptive_clipping, target_quantile
        self.clip_lr, self.count_noise = clip_lr, count_noise
        self.clip_norm, self.noise_multiplier, self.delta = float(clip_norm), float(noise_multiplier), float(delta)
        self.current_clip = self.clip_norm  # C_t (adaptive clipping changes it every round)
        self.target_epsilon, self.budget, self.clipping, self.method = target_epsilon, budget, clipping, accountant
        self.scheme: SamplingScheme | None = None
        self.accountant: ClientAccountant | None = None
        self._restored: dict[str, torch.Tensor] | None = None
        self._stages = [ClipStage(self), GaussianSumNoise(self)]

    def stages(self) -> list:
        """The uplink stages this setting contributes: clip (client) and Gaussian noise (server)."""
        return list(self._stages)

    @property
    def update_noise(self) -> float:
        """The noise multiplier of the clipped sum: sigma, or under adaptive clipping
        (sigma^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et al., Thm 1)."""
        if not self.adaptive_clipping:
            return self.noise_multiplier
        return (self.noise_multiplier**-2 - (2 * self.sigma_b) ** -2) ** -0.5

    @property
    def queries(self) -> float | tuple[float, float]:
        """What the accountant composes each round: sigma, or (update sigma, count sigma)."""
        return (self.update_noise, self.sigma_b) if self.adaptive_clipping else self.noise_multiplier

    def prepare(self, participation: Any, num_clients: int, rounds: int, seed: int = 0) -> None:
        """Before training: the sampling scheme, sigma (calibrated to ``target_epsilon`` if asked, or
        restored from a checkpoint) and the accountant (replayed to the checkpoint's round)."""
        self.scheme = SamplingScheme.of(participation, num_clients)
        if self.method == "pld" and self.scheme.kind == "without_replacement":
            raise ValueError(
                "privacy.accountant=pld cannot account UniformSampling (sampling without replacement): dp-accounting's PLD "
                "accountant has no rule for it; use accountant: rdp, or BernoulliParticipation (Poisson sampling)"
            )
        restored = self._restored
        if restored is not None and "noise_multiplier" in restored:
            saved = float(restored["noise_multiplier"])
            if self.target_epsilon is None and saved != self.noise_multiplier:  # (a calibrated sigma is the checkpoint's)
                raise ValueError(
                    f"privacy.noise_multiplier={self.noise_multiplier:g} differs from the checkpoint's {saved:g}: the accountant "
                    "would compose rounds that did not happen; resume with the settings the run was started with"
                )
            self.noise_multiplier = saved
        elif self.target_epsilon is not None and self.budget == "calibrate":
            self.noise_multiplier = calibrate_noise(self.scheme, self.target_epsilon, self.delta, rounds, self.method)
            log.warning(
                "privacy: target_epsilon=%g calibrates noise_multiplier to %.4g for %d rounds (delta=%g)",
                self.target_epsilon, self.noise_multiplier, rounds, self.delta,
            )  # fmt: skip
        elif self.target_epsilon is not None:
            if epsilon_after(self.scheme, self.noise_multiplier, self.delta, 1, self.method) > self.target_epsilon:
                raise ValueError(
                    f"privacy.target_epsilon={self.target_epsilon} is exceeded by a single round at noise_multiplier="
                    f"{self.noise_multiplier}; raise target_epsilon or noise_multiplier"
                )
            log.warning(
                "privacy: training at noise_multiplier=%g until epsilon would exceed target_epsilon=%g (delta=%g), then stopping",
                self.noise_multiplier, self.target_epsilon, self.delta,
            )  # fmt: skip
        self.seed = seed
        if self.adaptive_clipping:
            self.sigma_b = self.count_noise if self.count_noise is not None else self.scheme.expected_cohort(0) / 20
            if not 2 * self.sigma_b * self.noise_multiplier > 1:
                raise ValueError(
                    f"privacy.count_noise={self.sigma_b:g} must exceed 1 / (2 noise_multiplier) = {1 / (2 * self.noise_multiplier):g} "
                    "(the count would spend the whole budget); raise count_noise or noise_multiplier"
                )
        if restored is not None and "current_clip" in restored:
            if not self.adaptive_clipping and float(restored["current_clip"]) != self.clip_norm:
                raise ValueError(
                    f"privacy.clip_norm={self.clip_norm:g} differs from the checkpoint's {float(restored['current_clip']):g}; "
                    "resume with the settings the run was started with"
                )
            self.current_clip = float(restored["current_clip"])
        self.accountant = ClientAccountant(self.scheme, self.queries, self.delta, self.method)
        if restored is not None:
            self.accountant.replay(int(restored.get("rounds", torch.tensor(0))))

    def budget_exhausted(self) -> bool:
        """With ``budget="stop"``: whether one more round would spend more than ``target_epsilon``."""
        if self.target_epsilon is None or self.budget != "stop" or self.accountant is None:
            return False
        return self.accountant.epsilon_after_next() > self.target_epsilon

    def account(self, info: RoundInfo) -> dict[str, float]:
        """One more round accounted (and, with adaptive clipping, C updated); the metrics logged with it."""
        self.accountant.step()
        epsilons = self.accountant.epsilons()
        metrics = {"privacy/epsilon": float(epsilons.max()), "privacy/noise_multiplier": self.noise_multiplier}
        if self.adaptive_clipping:
            metrics["privacy/clip_norm"] = self.current_clip  # the C this round clipped with
            self.current_clip = self.next_clip(_summed_over_processes(self._stages[0].unclipped), info)
        if self.scheme.kind == "poisson":  # clients differ when their probabilities do
            metrics["privacy/epsilon_median"] = float(torch.tensor(epsilons).median())
            metrics["privacy/epsilon_min"] = float(epsilons.min())
        return metrics

    def next_clip(self, unclipped: int, info: RoundInfo) -> float:
        """C_{t+1} = C_t exp(-eta_C (b~ - gamma)), b~ = (unclipped + N(0, sigma_b^2)) / D (Andrew et al., Alg. 1),
        the noise drawn on the server from (seed, round)."""
        from fl_lightning.pipeline.messages import SERVER_STREAM
        from fl_lightning.core.participation import derive_seed

        generator = StageKey(derive_seed(self.seed, info.round, SERVER_STREAM), info.round).generator(COUNT_STREAM)
        noise = float(torch.randn((), generator=generator, dtype=torch.float64)) * self.sigma_b
        noisy = (unclipped + noise) / self.scheme.expected_cohort(info.round)
        return self.current_clip * math.exp(-self.clip_lr * (noisy - self.target_quantile))

    def state_dict(self) -> dict[str, torch.Tensor]:
        rounds = self.accountant.rounds if self.accountant is not None else 0
        return {
            "rounds": torch.tensor(rounds), "noise_multiplier": torch.tensor(self.noise_multiplier, dtype=torch.float64),
            "current_clip": torch.tensor(self.current_clip, dtype=torch.float64),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._restored = dict(state)
        if self.accountant is not None:  # already prepared: replay now
            self.noise_multiplier = float(state["noise_multiplier"])
            if "current_clip" in state:
                self.current_clip = float(state["current_clip"])
            self.accountant = ClientAccountant(self.scheme, self.queries, self.delta, self.method)
            self.accountant.replay(int(state["rounds"]))

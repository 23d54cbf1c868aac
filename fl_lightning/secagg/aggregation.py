"""Secure aggregation with optional distributed DP, its setting and one round of it (docs/privacy.md, "Secure
aggregation and distributed DP"; docs/algorithms.md, section 31).

A round: every client of the round's plan advertises keys and deals its shares (31.3), each client that trained
clips its flattened upload to C (31.1) and encodes it as integers, either in fixed point at the scale s that keeps
the sum from wrapping (31.2) or, under distributed DP, rotated (31.6), conditionally rounded (31.7) at the
granularity gamma (31.8) with discrete Gaussian (31.9) or Skellam (31.10) noise added; it masks the residues modulo
M = 2^bits and sends them. Clients drop out before training (``model.faults``) or after masking (a fraction
``dropout_after_masking`` of those that trained); the server unmasks the sum of what arrived with the survivors'
shares (31.5) and decodes it. Overflow of the sum beyond [-M/2, M/2) is counted, never silent.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from fl_lightning.core.participation import derive_seed
from fl_lightning.secagg import encoding, protocol
from fl_lightning.secagg.accounting import ddg_rdp, l1_sensitivity, skellam_rdp
from fl_lightning.secagg.graph import neighbour_graph
from fl_lightning.secagg.samplers import discrete_gaussian, skellam

GRAPH_STREAM, ROTATION_STREAM, ROUND_STREAM, NOISE_STREAM, LATE_STREAM, KEY_STREAM = 0x5A0, 0x5A1, 0x5A2, 0x5A3, 0x5A4, 0x5A5
"""Seed streams: the graph and the rotation (from the server's round seed, shared by all), and each client's
rounding, noise, late dropout and secrets (from its round seed)."""


@dataclass
class SecureSum:
    """One round's outcome: the decoded sum of the arrived clients' (clipped, noised) vectors, which clients arrived
    (positions in the plan), the round's RDP curve (distributed DP), and its metrics."""

    total: Tensor
    arrived: list[int]
    rdp: object = None
    metrics: dict[str, float] = field(default_factory=dict)


class SecureAggregation:
    """Secure aggregation (SecAgg / SecAgg+) of the uploads, with optional distributed DP (``--model.secure_aggregation``).

    Args:
        bits: b, the modulus M = 2^b of the masked sum, in [2, 62].
        clip: C > 0, the L2 bound of each client's flattened upload (every entry together).
        neighbours: k, SecAgg+'s graph degree (an even integer >= 2); None: classic SecAgg (every pair).
        threshold: the fraction of a client's neighbours whose shares reconstruct its secrets, in (0, 1]:
            t = ceil(threshold k) (at least 1).
        dropout_after_masking: the probability in [0, 1) that a client that trained and masked never delivers its
            masked vector (drawn from its round seed).
        noise: None (no DP), ``"gaussian"`` (distributed discrete Gaussian) or ``"skellam"``.
        noise_multiplier: z >= 0: the summed noise's standard deviation is z C when every client of the plan
            arrives (each adds a 1/n share of the variance).
        delta: the delta of the reported (epsilon, delta), in (0, 1).
        k_stddevs: distributed DP's modular range covers this many standard deviations of a summed coordinate (> 0).
        beta: conditional rounding's probability of a redraw, in (0, 1).
    """

    method = "rdp"
    """How distributed DP's rounds are accounted (the terminal's closing line names it)."""

    def __init__(
        self,
        bits: int = 20,
        clip: float = 1.0,
        neighbours: int | None = None,
        threshold: float = 0.5,
        dropout_after_masking: float = 0.0,
        noise: Literal["gaussian", "skellam"] | None = None,
        noise_multiplier: float = 1.0,
        delta: float = 1e-5,
        k_stddevs: float = 4.0,
        beta: float = math.exp(-0.5),
    ) -> None:
        if not (isinstance(bits, int) and 2 <= bits <= 62):
            raise ValueError(f"secure_aggregation.bits must be an integer in [2, 62], got {bits}")
        if not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
            raise ValueError(f"secure_aggregation.clip must be > 0 (finite), got {clip}")
        if neighbours is not None and not (isinstance(neighbours, int) and neighbours >= 2 and neighbours % 2 == 0):
            raise ValueError(f"secure_aggregation.neighbours must be an even integer >= 2 (or null: every pair), got {neighbours}")
        if not 0 < threshold <= 1:
            raise ValueError(f"secure_aggregation.threshold must be in (0, 1], got {threshold}")
        if not 0 <= dropout_after_masking < 1:
            raise ValueError(f"secure_aggregation.dropout_after_masking must be in [0, 1), got {dropout_after_masking}")
        if noise not in (None, "gaussian", "skellam"):
            raise ValueError(f"secure_aggregation.noise must be null, 'gaussian' or 'skellam', got {noise!r}")
        if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"secure_aggregation.noise_multiplier must be >= 0 (finite), got {noise_multiplier}")
        if not 0 < delta < 1:
            raise ValueError(f"secure_aggregation.delta must be in (0, 1), got {delta}")
        if not k_stddevs > 0:
            raise ValueError(f"secure_aggregation.k_stddevs must be > 0, got {k_stddevs}")
        if not 0 < beta < 1:
            raise ValueError(f"secure_aggregation.beta must be in (0, 1), got {beta}")
        self.bits, self.clip, self.neighbours, self.threshold = bits, float(clip), neighbours, float(threshold)
        self.dropout_after_masking, self.noise, self.noise_multiplier = float(dropout_after_masking), noise, float(noise_multiplier)
        self.delta, self.k_stddevs, self.beta = float(delta), float(k_stddevs), float(beta)

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def check_cohort(self, clients: int) -> None:
        """Refuse a bit width too small for ``clients`` clients' sum, in one line."""
        if self.noise is None and encoding.plain_scale(self.bits, clients, self.clip) <= 0:
            raise ValueError(
                f"secure_aggregation.bits={self.bits} cannot hold the sum of {clients} clients' rounded values without wrapping; "
                f"raise bits to at least {math.ceil(math.log2(2 * (clients + 1))) + 1}"
            )
        if self.noise is not None:
            encoding.granularity(self.bits, clients, self.clip, 1, 0.0, self.k_stddevs)

    def thresholds(self, graph: list[set[int]]) -> list[int]:
        return [max(1, math.ceil(self.threshold * len(n))) if n else 1 for n in graph]

    def late_dropouts(self, seeds: list[int]) -> list[bool]:
        """Whether each client drops after masking (its masked vector never arrives), from its round seed."""
        if self.dropout_after_masking == 0:
            return [False] * len(seeds)
        draws = [float(torch.rand((), generator=torch.Generator().manual_seed(derive_seed(s, LATE_STREAM)), dtype=torch.float64)) for s in seeds]
        return [u < self.dropout_after_masking for u in draws]

    # ---- one round ------------------------------------------------------------------------------
    def encode(self, vectors: Tensor, seeds: list[int], clients: int, signs: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """The clients' integer vectors (signed, not yet reduced): rows of ``vectors`` clipped, scaled, (rotated,)
        rounded (and noised), each client's draws from its own round seed; the encoding's facts."""
        clipped = encoding.clip_rows(vectors, self.clip)
        if self.noise is None:
            scale = encoding.plain_scale(self.bits, clients, self.clip)
            ints = [encoding.stochastic_round(row * scale, self._generator(s, ROUND_STREAM)) for row, s in zip(clipped, seeds)]
            return torch.stack(ints), {"scale": scale}
        size = signs.numel()
        gamma = encoding.granularity(self.bits, clients, self.clip, size, self.noise_multiplier * self.clip, self.k_stddevs)
        rotated = encoding.rotate(clipped, signs) / gamma
        bound = encoding.rounded_norm_bound(self.clip / gamma, size, self.beta)
        local = self.noise_multiplier * self.clip / (gamma * math.sqrt(clients))  # each client's std, integer units
        ints, draws = [], 0
        for row, s in zip(rotated, seeds):
            rounded, tries = encoding.conditional_round(row, bound, self._generator(s, ROUND_STREAM))
            draw = discrete_gaussian if self.noise == "gaussian" else skellam
            noise = draw(local if self.noise == "gaussian" else local**2, size, self._generator(s, NOISE_STREAM))
            ints.append(rounded + noise)
            draws += tries
        facts = {"gamma": gamma, "l2": bound, "local_std": local, "size": size, "rounding_draws": draws / max(1, len(seeds))}
        return torch.stack(ints) if ints else torch.zeros(0, size, dtype=torch.int64), facts

    def run(self, vectors: Tensor, trained: list[int], seeds: list[int], server_seed: int) -> SecureSum:
        """One round of the protocol. ``seeds``: the round seeds of every client of the plan (the protocol's n, by
        position); ``trained``: the positions whose flattened uploads are the rows of ``vectors``. Raises
        ``TooFewShares`` (one line) when a secret cannot be reconstructed."""
        n, modulus, size = len(seeds), self.modulus, vectors.shape[1]
        graph = neighbour_graph(n, self.neighbours, self._generator(server_seed, GRAPH_STREAM))
        thresholds = self.thresholds(graph)
        started = time.perf_counter()
        parties = protocol.setup([derive_seed(s, KEY_STREAM) for s in seeds], graph, thresholds)
        setup_s = time.perf_counter() - started
        signs = None
        if self.noise is not None:
            flips = torch.randint(0, 2, (encoding.padded(size),), generator=self._generator(server_seed, ROTATION_STREAM))
            signs = 1.0 - 2.0 * flips.double()
        started = time.perf_counter()
        ints, facts = self.encode(vectors, [seeds[p] for p in trained], n, signs)
        late = self.late_dropouts([seeds[p] for p in trained])
        masked = {p: protocol.masked_input(p, ints[r] % modulus, parties, graph, modulus) for r, p in enumerate(trained)}
        client_s = (time.perf_counter() - started) / max(1, len(trained)) + setup_s / max(1, n)
        arrived = {p: z for (r, p), z in zip(enumerate(trained), masked.values()) if not late[r]}
        started = time.perf_counter()
        total = protocol.unmask(arrived, parties, graph, thresholds, modulus) if arrived else torch.zeros(ints.shape[1], dtype=torch.int64)
        server_s = time.perf_counter() - started
        true_sum = ints[[r for r, p in enumerate(trained) if not late[r]]].sum(0)
        overflow = int(((true_sum < -modulus // 2) | (true_sum >= modulus // 2)).sum())
        signed = encoding.to_signed(total, modulus).double()
        if self.noise is None:
            decoded = signed / facts["scale"]
        else:
            decoded = encoding.unrotate(signed * facts["gamma"], signs, size)
        arrivals = sorted(arrived)
        metrics = self._metrics(graph, arrivals, n, size, facts, client_s, server_s, overflow)
        rdp = None
        if self.noise is not None:
            l1, width = l1_sensitivity(facts["l2"], facts["size"]), facts["size"]
            if self.noise == "gaussian":
                rdp = ddg_rdp(facts["l2"], l1, facts["local_std"], len(arrivals), width)
            else:
                rdp = skellam_rdp(facts["l2"], l1, len(arrivals) * facts["local_std"] ** 2)
        return SecureSum(decoded, arrivals, rdp, metrics)

    def _metrics(self, graph, arrivals, n, size, facts, client_s, server_s, overflow) -> dict[str, float]:
        arrived = set(arrivals)
        width = facts.get("size", size)
        per_client = [protocol.protocol_bytes(width, self.bits, len(graph[i]), len(graph[i] & arrived) if i in arrived else 0) for i in arrivals]
        dealt = protocol.ELEMENT_BYTES * sum(1 + 2 * len(graph[i]) for i in range(n) if i not in arrived)  # keys and shares of the dropped
        up = sum(per_client) + dealt
        metrics = {
            "secagg/clients": float(len(arrivals)), "secagg/dropped": float(n - len(arrivals)), "secagg/overflow": float(overflow),
            "secagg/vector_bytes": float(-(-width * self.bits // 8)), "secagg/bytes_per_client": sum(per_client) / max(1, len(per_client)),
            "secagg/round_bytes_up": float(up), "secagg/expansion": (sum(per_client) / max(1, len(per_client))) / (4 * size),
            "secagg/client_seconds": client_s, "secagg/server_seconds": server_s,
            "secagg/degree": sum(len(g) for g in graph) / max(1, n),
        }  # fmt: skip
        if "gamma" in facts:
            metrics.update({"secagg/gamma": facts["gamma"], "secagg/rounding_draws": facts["rounding_draws"]})
        return metrics

    @staticmethod
    def _generator(seed: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(seed, stream))

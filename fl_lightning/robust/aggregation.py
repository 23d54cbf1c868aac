"""Robust aggregation as the server's combination of the round's uploads (``--model.robust.*``;
docs/robustness.md, docs/algorithms.md (26.1.1)).

The module, for an algorithm whose aggregate is a weighted combination of uploads
(``linear_aggregate``), replaces the weighted mean: it stacks the round's decoded uploads (after the
client stages: clip, compress), lets the rule compute r, the robust estimate of the mean upload, and
hands the algorithm ``upload_sum(x, [r] * n, weights)``: every upload replaced by r, so each entry
keeps the algorithm's own weights and total mass (FedAvg's ``sum_i w_i delta_i`` becomes
``(sum_i w_i) r``; SCAFFOLD's ``delta_c / N`` sum becomes ``n r_c / N``). Then any aggregate stage's
extra upload (privacy's noise) is added. Order: clip -> compress -> robust aggregation -> noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core.tasks import Payload
from fl_lightning.robust.base import Combined, RobustRule
from fl_lightning.robust.bulyan import Bulyan
from fl_lightning.robust.centered_clipping import CenteredClipping
from fl_lightning.robust.fltrust import FLTrust
from fl_lightning.robust.geometric_median import GeometricMedian
from fl_lightning.robust.krum import Krum, MultiKrum
from fl_lightning.robust.median import Median
from fl_lightning.robust.norm_bound import NormBound
from fl_lightning.robust.trimmed_mean import TrimmedMean

RULES = ("median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median", "centered_clipping", "norm_bound", "fltrust")
DP_SAFE = ("norm_bound",)
"""Rules whose output is a weighted mean with each client's weight fixed and its upload's norm bounded:
the only ones under which client-level DP's sensitivity argument (one client moves the sum by at most
C / m) still holds."""


def stack(uploads: list[Payload]) -> tuple[Tensor, list[tuple[str, str, torch.Size, torch.dtype]]]:
    """The uploads as rows ``[n, d]`` (entries and tensors in the first upload's order) and the layout."""
    layout = [(e, k, t.shape, t.dtype) for e, td in uploads[0].items() for k, t in td.items()]
    dtype = torch.float32
    for *_, dt in layout:
        dtype = torch.promote_types(dtype, dt)
    rows = []
    for i, upload in enumerate(uploads):
        if [(e, k, t.shape) for e, td in upload.items() for k, t in td.items()] != [(e, k, s) for e, k, s, _ in layout]:
            raise ValueError(f"robust aggregation needs every upload of a round shaped alike; upload {i} differs from upload 0")
        rows.append(torch.cat([upload[e][k].reshape(-1).to(dtype) for e, k, *_ in layout]))
    return torch.stack(rows), layout


def unstack(vector: Tensor, layout) -> Payload:
    out: Payload = {}
    start = 0
    for entry, name, shape, dtype in layout:
        size = math.prod(shape)
        out.setdefault(entry, {})[name] = vector[start : start + size].reshape(shape).to(dtype)
        start += size
    return out


@dataclass
class RoundOutcome:
    """One round's robust combination: r as an upload, the kept client ids (selecting rules), metrics."""

    upload: Payload
    kept: list[int] | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Robust:
    """Byzantine-robust aggregation (``--model.robust.*``; docs/robustness.md).

    Args:
        rule: median, trimmed_mean, krum, multi_krum, bulyan, geometric_median, centered_clipping, norm_bound, fltrust.
        f: the number of attackers among a round's reporting clients the rule must tolerate.
        fraction: instead of f, the assumed fraction of attackers: f = floor(fraction * n) of the n reporting.
        beta: trimmed_mean's trimmed fraction per side (b = floor(beta n)); null: b = f.
        m: multi_krum's number of kept clients; null: n - f.
        iters: geometric_median's most Weiszfeld iterations (default 100) or centered_clipping's iterations (default 1).
        tol: geometric_median's stop: a step moved v by at most tol (||v|| + nu) (default 1e-6; 0: always ``iters`` steps).
        nu: geometric_median's smoothing (the smallest distance it divides by).
        tau: centered_clipping's radius.
        max_norm: norm_bound's bound M on each upload's norm.
        root_size: fltrust's root dataset, this many training samples drawn by seed (the server trains on it).
    """

    rule: str = "median"
    f: int | None = None
    fraction: float | None = None
    beta: float | None = None
    m: int | None = None
    iters: int | None = None
    tol: float = 1e-6
    nu: float = 1e-6
    tau: float = 1.0
    max_norm: float = 1.0
    root_size: int = 100

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"robust.rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.f is not None and self.f < 0:
            raise ValueError(f"robust.f must be an integer >= 0, got {self.f}")
        if self.fraction is not None and not 0 <= self.fraction < 1:
            raise ValueError(f"robust.fraction must be in [0, 1), got {self.fraction}")
        if self.beta is not None and not 0 <= self.beta < 0.5:
            raise ValueError(f"robust.beta must be in [0, 0.5) (2 beta < 1), got {self.beta}")
        if self.m is not None and self.m < 1:
            raise ValueError(f"robust.m must be an integer >= 1 (or null for n - f), got {self.m}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"robust.iters must be an integer >= 1, got {self.iters}")
        for name in ("nu", "tau", "max_norm"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"robust.{name} must be > 0, got {getattr(self, name)}")
        if self.root_size < 1:
            raise ValueError(f"robust.root_size must be an integer >= 1, got {self.root_size}")
        if self.f is not None and self.fraction is not None:
            raise ValueError("robust.f and robust.fraction both set: give the number of attackers or their fraction, not both")
        self.rule_impl = self._build()
        self.malicious: set[int] | None = None  # set by an attack (fl_lightning.adversary) to split the norm metric

    def _build(self) -> RobustRule:
        iters = {} if self.iters is None else {"iters": self.iters}
        return {
            "median": lambda: Median(),
            "trimmed_mean": lambda: TrimmedMean(self.beta),
            "krum": lambda: Krum(),
            "multi_krum": lambda: MultiKrum(self.m),
            "bulyan": lambda: Bulyan(),
            "geometric_median": lambda: GeometricMedian(nu=self.nu, tol=self.tol, **iters),
            "centered_clipping": lambda: CenteredClipping(self.tau, **iters),
            "norm_bound": lambda: NormBound(self.max_norm),
            "fltrust": lambda: FLTrust(),
        }[self.rule]()

    # ---- the assumption on f ------------------------------------------------------------------------
    def attackers(self, n: int) -> int:
        """f for a round with n reporting clients."""
        if self.fraction is not None:
            return math.floor(self.fraction * n)
        return self.f or 0

    def violation(self, n: int) -> str | None:
        """Why n reporting clients are too few for the rule with its f (None: enough)."""
        f, rule = self.attackers(n), self.rule_impl
        if self.fraction is not None and rule.needs_majority and self.fraction >= 0.5:
            return f"robust.rule={self.rule} needs a majority of honest clients: robust.fraction must be < 0.5, got {self.fraction}"
        if isinstance(rule, TrimmedMean) and n <= 2 * rule.trimmed(n, f):
            b = rule.trimmed(n, f)
            return f"robust.rule=trimmed_mean trims b={b} per side of n={n} clients: needs n > 2b"
        if n < rule.min_clients(f):
            return f"robust.rule={self.rule} needs {rule.requirement(f)}: got n={n} reporting clients and f={f}"
        return None

    def check_with_privacy(self) -> None:
        """Client-level DP (clip -> robust aggregation -> noise) keeps its guarantee only where the rule's output
        is a mean with fixed weights of uploads of bounded norm (``DP_SAFE``); any other rule is refused."""
        if self.rule not in DP_SAFE:
            raise ValueError(
                f"robust.rule={self.rule} with privacy: client-level DP's noise covers one client moving the sum by at most C/m, "
                f"which {self.rule} breaks (its output is not a mean with fixed bounded weights: one client changes how the others "
                "count); use robust.rule=norm_bound or remove privacy"
            )

    def check(self, algorithm: Any, cohort: int | None) -> None:
        """One line before training: an algorithm whose aggregate is not a weighted combination of uploads,
        a fraction without an honest majority where the rule needs one, too few clients per round."""
        from fl_lightning.algorithms.base import declares_capability
        from fl_lightning.pipeline.messages import sends_no_model_shaped_upload

        name = type(algorithm).__name__
        if not declares_capability(algorithm, "linear_aggregate"):
            raise ValueError(
                f"robust.rule={self.rule} cannot replace {name}'s aggregate: it is not a weighted combination of the uploads "
                "(its class does not declare linear_aggregate, e.g. it reads each client's steps or norms); remove robust"
            )
        if sends_no_model_shaped_upload(algorithm):
            raise ValueError(f"robust.rule={self.rule} cannot combine {name}'s uploads: they are not shaped like the model; remove robust")
        if self.needs_reference and (algorithm.warmup_pass or getattr(algorithm, "needs_label_counts", False)):
            raise ValueError(
                f"robust.rule=fltrust cannot train {name} on its root dataset (a warm-up pass or per-client label counts); "
                "use another rule"
            )
        if self.fraction is not None and self.rule_impl.needs_majority and self.fraction >= 0.5:
            raise ValueError(self.violation(1))
        if cohort is not None:
            line = self.violation(cohort)
            if line is not None:
                raise ValueError(f"{line} (clients per round)")

    @property
    def needs_reference(self) -> bool:
        """Whether the rule compares the uploads with the server's own update on its root dataset (FLTrust)."""
        return getattr(self.rule_impl, "needs_reference", False)

    # ---- one round ------------------------------------------------------------------------------------
    def combine(self, uploads: list[Payload], weights: Tensor, client_ids: list[int], reference: Payload | None = None) -> RoundOutcome:
        """The robust combination of the round's uploads (client ``client_ids[i]`` sent ``uploads[i]``);
        ``reference``: the server's own upload on its root dataset (FLTrust), shaped like an upload."""
        V, layout = stack(uploads)
        w = torch.as_tensor(weights, dtype=torch.float64).to(V.device)
        w = w / w.sum() if float(w.sum()) > 0 else torch.full_like(w, 1.0 / len(uploads))
        f = self.attackers(len(uploads))
        if self.needs_reference:
            out: Combined = self.rule_impl.combine(V, w, f, stack([*uploads[:1], reference])[0][1] if reference is not None else None)
        else:
            out = self.rule_impl.combine(V, w, f)
        metrics = self.norm_metrics(torch.linalg.vector_norm(V, dim=1), client_ids)
        kept = None if out.kept is None else [client_ids[i] for i in out.kept]
        if kept is not None:
            metrics["robust/kept_fraction"] = len(kept) / len(client_ids)
            metrics.update(self.detection_metrics(client_ids, kept))
        return RoundOutcome(unstack(out.vector, layout), kept, metrics)

    def detection_metrics(self, client_ids: list[int], kept: list[int]) -> dict[str, float]:
        """A selecting rule as a detector of the known attackers: how many malicious and benign uploads it kept;
        precision (the share of the excluded that were malicious) and recall (the share of the malicious excluded),
        where defined (nothing excluded: no precision; no attacker reporting: no recall)."""
        if self.malicious is None:
            return {}
        kept_set = set(kept)
        malicious = [c for c in client_ids if c in self.malicious]
        excluded = [c for c in client_ids if c not in kept_set]
        caught = [c for c in excluded if c in self.malicious]
        metrics = {"robust/kept_malicious": float(len(malicious) - len(caught)), "robust/kept_benign": float(len(kept) - len(malicious) + len(caught))}
        if excluded:
            metrics["robust/detection_precision"] = len(caught) / len(excluded)
        if malicious:
            metrics["robust/detection_recall"] = len(caught) / len(malicious)
        return metrics

    def mark_malicious(self, client_ids: set[int] | None) -> None:
        """The attackers' client ids (from an attack), to split ``robust/upload_norm_mean`` into
        ``robust/norm_benign`` and ``robust/norm_malicious``; None: not known."""
        self.malicious = None if client_ids is None else {int(c) for c in client_ids}

    def norm_metrics(self, norms: Tensor, client_ids: list[int]) -> dict[str, float]:
        """``robust/upload_norm_mean``; with ``malicious`` ids known, ``robust/norm_benign`` and ``robust/norm_malicious``."""
        metrics = {"robust/upload_norm_mean": float(norms.mean())}
        if self.malicious is not None:
            bad = [i for i, c in enumerate(client_ids) if c in self.malicious]
            good = [i for i, c in enumerate(client_ids) if c not in self.malicious]
            for key, rows in (("robust/norm_benign", good), ("robust/norm_malicious", bad)):
                if rows:
                    metrics[key] = float(norms[rows].mean())
        return metrics

    def state_dict(self) -> dict[str, Tensor]:
        return self.rule_impl.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.rule_impl.load_state_dict(state)

"""Each robust rule equals an independent numpy implementation on random uploads with ties (float64, 1e-12),
through the payload contract (two entries, as SCAFFOLD uploads), and its assumption on f is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.robust import Robust

TOL = 1e-12


# ---- independent references (numpy) ---------------------------------------------------------------
def np_median(V):
    return np.median(V, axis=0)


def np_trimmed(V, b):
    S = np.sort(V, axis=0)
    return S[b : len(V) - b].mean(axis=0)


def np_krum_scores(V, f):
    n = len(V)
    k = max(n - f - 2, 1)
    scores = []
    for i in range(n):
        d = [float(np.sum((V[i] - V[j]) ** 2)) for j in range(n) if j != i]
        scores.append(sum(sorted(d)[:k]))
    return np.array(scores)


def np_multi_krum(V, f, m):
    s = np_krum_scores(V, f)
    kept = sorted(np.argsort(s, kind="stable")[:m].tolist())
    return V[kept].mean(axis=0), kept


def np_bulyan(V, f):
    idx = list(range(len(V)))
    kept = []
    while len(kept) < len(V) - 2 * f:
        s = np_krum_scores(V[idx], f) if len(idx) > 1 else np.zeros(1)
        kept.append(idx.pop(int(np.argmin(s))))
    kept.sort()
    S = V[kept]
    beta = len(kept) - 2 * f
    med = np.median(S, axis=0)
    out = np.empty(V.shape[1])
    for j in range(V.shape[1]):
        order = np.argsort(np.abs(S[:, j] - med[j]), kind="stable")[:beta]
        out[j] = S[order, j].mean()
    return out, kept


def np_geomed(V, w, iters, nu):
    w = w / w.sum()
    v = (w[:, None] * V).sum(0) / w.sum()
    for _ in range(iters):
        b = w / np.maximum(nu, np.sqrt(((V - v) ** 2).sum(1)))
        v = (b[:, None] * V).sum(0) / b.sum()
    return v


def np_clip_rows(Z, tau):
    norms = np.sqrt((Z**2).sum(1))
    return Z * np.minimum(1.0, tau / np.maximum(norms, np.finfo(float).tiny))[:, None]


def np_centered_clipping(V, center, tau, iters):
    v = center.copy()
    for _ in range(iters):
        v = v + np_clip_rows(V - v, tau).mean(0)
    return v


def np_fltrust(V, g0):
    g0n = np.sqrt(g0 @ g0)
    total, acc = 0.0, np.zeros_like(g0)
    for v in V:
        vn = np.sqrt(v @ v)
        ts = max(0.0, float(v @ g0) / (vn * g0n))
        total += ts
        acc += ts * v * (g0n / vn)
    return acc / total if total > 0 else np.zeros_like(g0)


def np_norm_bound(V, w, M):
    w = w / w.sum()
    return (w[:, None] * np_clip_rows(V, M)).sum(0) / w.sum()


# ---- the uploads ------------------------------------------------------------------------------------
def uploads(n, seed, ties=True):
    """n SCAFFOLD-shaped uploads (delta: two tensors, delta_c: one), values on a coarse grid (ties in every
    coordinate), two identical clients, and their flat rows in the contract's order."""
    rng = np.random.default_rng(seed)
    V = rng.integers(-3, 4, size=(n, 11)).astype(np.float64) / 2 if ties else rng.normal(size=(n, 11))
    V[1] = V[0]
    V[-1] *= 25.0  # an outlier
    out = []
    for row in V:
        t = torch.from_numpy(row.copy())
        out.append({"delta": {"w": t[:6].reshape(2, 3), "b": t[6:8]}, "delta_c": {"w": t[8:].reshape(3)}})
    return out, V


def flat(payload):
    return torch.cat([payload["delta"]["w"].reshape(-1), payload["delta"]["b"], payload["delta_c"]["w"]]).numpy()


CASES = [(n, seed, ties) for n, seed in ((7, 0), (8, 1), (11, 2)) for ties in (True, False)]


@pytest.mark.parametrize("n,seed,ties", CASES)
def test_rules_equal_numpy_references(n, seed, ties):
    ups, V = uploads(n, seed, ties)
    w = np.random.default_rng(seed + 100).uniform(0.5, 2.0, n)
    ids = list(range(100, 100 + n))
    f = 1

    def run(**kw):
        robust = Robust(**kw)
        return robust.combine(ups, torch.from_numpy(w), ids)

    diffs = {}
    out = run(rule="median")
    diffs["median"] = np.abs(flat(out.upload) - np_median(V)).max()
    for beta, b in ((None, f), (0.25, int(np.floor(0.25 * n)))):
        out = run(rule="trimmed_mean", f=f, beta=beta)
        diffs[f"trimmed_mean b={b}"] = np.abs(flat(out.upload) - np_trimmed(V, b)).max()
    ref, kept = np_multi_krum(V, f, 1)
    out = run(rule="krum", f=f)
    assert out.kept == [ids[k] for k in kept]
    diffs["krum"] = np.abs(flat(out.upload) - ref).max()
    for m in (None, 3):
        ref, kept = np_multi_krum(V, f, n - f if m is None else m)
        out = run(rule="multi_krum", f=f, m=m)
        assert out.kept == [ids[k] for k in kept]
        assert out.metrics["robust/kept_fraction"] == len(kept) / n
        diffs[f"multi_krum m={m}"] = np.abs(flat(out.upload) - ref).max()
    bf = 1 if n >= 7 else 0
    ref, kept = np_bulyan(V, bf)
    out = run(rule="bulyan", f=bf)
    assert out.kept == [ids[k] for k in kept]
    diffs["bulyan"] = np.abs(flat(out.upload) - ref).max()
    out = run(rule="geometric_median", iters=20, nu=1e-6, tol=0.0)
    diffs["geometric_median"] = np.abs(flat(out.upload) - np_geomed(V, w, 20, 1e-6)).max()
    robust = Robust(rule="centered_clipping", tau=2.0, iters=3)
    first = robust.combine(ups, torch.from_numpy(w), ids)
    second = robust.combine(ups, torch.from_numpy(w), ids)  # from the first round's output as center
    c1 = np_centered_clipping(V, np.zeros(V.shape[1]), 2.0, 3)
    diffs["centered_clipping"] = max(np.abs(flat(first.upload) - c1).max(), np.abs(flat(second.upload) - np_centered_clipping(V, c1, 2.0, 3)).max())
    g0 = V[2] + 0.5  # the server's update: most uploads agree with it, some point away (trust 0)
    assert (V @ g0 < 0).any() and (V @ g0 > 0).sum() > 1
    ref_payload = uploads(n, seed, ties)[0][0]
    flat_ref = torch.from_numpy(g0.copy())
    ref_payload = {"delta": {"w": flat_ref[:6].reshape(2, 3), "b": flat_ref[6:8]}, "delta_c": {"w": flat_ref[8:]}}
    out = Robust(rule="fltrust").combine(ups, torch.from_numpy(w), ids, ref_payload)
    diffs["fltrust"] = np.abs(flat(out.upload) - np_fltrust(V, g0)).max()
    out = run(rule="norm_bound", max_norm=3.0)
    diffs["norm_bound"] = np.abs(flat(out.upload) - np_norm_bound(V, w, 3.0)).max()
    print(n, seed, ties, {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v <= TOL for v in diffs.values()), diffs


def test_norm_metrics_split_benign_and_malicious():
    ups, V = uploads(6, 3)
    robust = Robust(rule="median")
    robust.mark_malicious({101, 105})
    m = robust.combine(ups, torch.ones(6), list(range(100, 106))).metrics
    norms = np.sqrt((V**2).sum(1))
    assert abs(m["robust/upload_norm_mean"] - norms.mean()) < TOL
    assert abs(m["robust/norm_malicious"] - norms[[1, 5]].mean()) < TOL
    assert abs(m["robust/norm_benign"] - norms[[0, 2, 3, 4]].mean()) < TOL


@pytest.mark.parametrize(
    "kw,cohort,line",
    [
        ({"rule": "krum", "f": 2}, 6, "robust.rule=krum needs n > 2f + 2: got n=6 reporting clients and f=2 (clients per round)"),
        ({"rule": "bulyan", "f": 1}, 6, "robust.rule=bulyan needs n >= 4f + 3: got n=6 reporting clients and f=1 (clients per round)"),
        ({"rule": "median", "fraction": 0.5}, 10, "robust.rule=median needs a majority of honest clients: robust.fraction must be < 0.5, got 0.5"),
        ({"rule": "trimmed_mean", "f": 3}, 6, "robust.rule=trimmed_mean trims b=3 per side of n=6 clients: needs n > 2b (clients per round)"),
        ({"rule": "multi_krum", "f": 1, "m": 5}, 5, "robust.rule=multi_krum needs n > 2f + 2 and m <= n - f (m=5): got n=5 reporting clients and f=1 (clients per round)"),
    ],
)
def test_violating_settings_are_one_line(kw, cohort, line):
    from fl_lightning.algorithms import FedAvg

    with pytest.raises(ValueError) as refused:
        Robust(**kw).check(FedAvg(), cohort)
    assert str(refused.value) == line


def test_refusals_of_algorithm_and_privacy():
    from fl_lightning.algorithms import SCAFFOLD, FedNova, FedProto

    with pytest.raises(ValueError, match="not a weighted combination of the uploads"):
        Robust(rule="median").check(FedNova(), 10)
    with pytest.raises(ValueError, match="FedProto's uploads: they are not shaped like the model"):
        Robust(rule="median").check(FedProto(), 10)
    with pytest.raises(ValueError, match="client-level DP's noise covers"):
        Robust(rule="multi_krum").check_with_privacy()
    Robust(rule="norm_bound").check_with_privacy()
    Robust(rule="bulyan", f=1).check(SCAFFOLD(), 7)
    with pytest.raises(ValueError, match=r"robust.beta must be in \[0, 0.5\)"):
        Robust(rule="trimmed_mean", beta=0.5)


def _honest_and_one(outlier_norm: float, dtype=torch.float32, n: int = 9, d: int = 50):
    g = torch.Generator().manual_seed(3)
    honest = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.1 + 0.05
    attacker = torch.full((1, d), outlier_norm / d**0.5, dtype=torch.float64)
    return torch.cat([honest, attacker]).to(dtype), honest


def test_the_geometric_median_is_finite_where_every_distance_would_overflow_in_float32():
    """One finite upload of entries 1e19 (norm about 7e19): ||v - V_i||^2 overflows float32; the rule stays finite
    and near the honest uploads' geometric median."""
    from fl_lightning.robust.geometric_median import GeometricMedian

    V, honest = _honest_and_one(1e19 * 50**0.5)
    out = GeometricMedian().combine(V, torch.ones(len(V)), 1).vector
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    reference = np_geomed(honest.numpy(), np.ones(len(honest)), 500, 1e-6)
    assert np.linalg.norm(out.double().numpy() - reference) < 0.1 * np.linalg.norm(honest.numpy(), axis=1).max()


def test_the_geometric_median_holds_its_breakdown_point_at_the_defaults():
    """One attacker of norm 2.4e14 among 9 honest clients: at the old fixed 8 iterations the output was 1.7e3 times the
    largest honest upload; stopping on the objective's tolerance it stays within the honest uploads' scale."""
    from fl_lightning.robust.geometric_median import GeometricMedian

    V, honest = _honest_and_one(2.4e14, dtype=torch.float64)
    largest = float(torch.linalg.vector_norm(honest, dim=1).max())
    old = GeometricMedian(iters=8, tol=0.0).combine(V, torch.ones(len(V)), 1).vector
    new = GeometricMedian().combine(V, torch.ones(len(V)), 1).vector
    assert float(torch.linalg.vector_norm(old)) > 100 * largest  # the bug, reproduced by the fixed iteration count
    assert float(torch.linalg.vector_norm(new)) < largest

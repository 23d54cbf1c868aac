"""Independent numpy (float64) references of the federated LoRA aggregations (docs/algorithms.md, section 28),
written from the equations, not from fl_lightning.lora: each returns (new A or None, new B or None, fold or None)."""

from __future__ import annotations

import numpy as np


def padded(a, b, rank):
    """A [r_i, in] and B [out, r_i] with zero rows / columns up to ``rank``."""
    ap = np.zeros((rank, a.shape[1]))
    ap[: a.shape[0]] = a
    bp = np.zeros((b.shape[0], rank))
    bp[:, : b.shape[1]] = b
    return ap, bp


def target(a, b, w):
    """sum_i w_i B_i A_i, the mean of the clients' updates."""
    return sum(wi * (bi @ ai) for ai, bi, wi in zip(a, b, w))


def fedit(a, b, w, rank):
    pads = [padded(ai, bi, rank) for ai, bi in zip(a, b)]
    return sum(wi * p[0] for p, wi in zip(pads, w)), sum(wi * p[1] for p, wi in zip(pads, w)), None


def flora(a, b, w, rank):
    """Stacking: B_s = [B_1 .. B_n] (columns), A_s = [w_1 A_1; ..; w_n A_n] (rows); fold B_s A_s, B restarts at 0."""
    b_s = np.concatenate(b, axis=1)
    a_s = np.concatenate([wi * ai for ai, wi in zip(a, w)], axis=0)
    return None, np.zeros((b[0].shape[0], rank)), b_s @ a_s


def fedex(a, b, w, rank):
    a_bar, b_bar, _ = fedit(a, b, w, rank)
    return a_bar, b_bar, target(a, b, w) - b_bar @ a_bar


def flexlora(a, b, w, rank):
    u, s, vt = np.linalg.svd(target(a, b, w), full_matrices=False)
    return np.sqrt(s[:rank])[:, None] * vt[:rank], u[:, :rank] * np.sqrt(s[:rank]), None


def hetlora(a, b, w, rank):
    norms = np.array([np.linalg.norm(bi @ ai, "fro") for ai, bi in zip(a, b)])
    p = np.asarray(w) * norms
    p = p / p.sum()
    return fedit(a, b, p, rank)


REFERENCES = {"factors": fedit, "stacked": flora, "exact_residual": fedex, "svd": flexlora, "zero_pad": hetlora}

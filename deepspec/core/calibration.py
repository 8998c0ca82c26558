"""Calibration of the confidence head (paper Sec. 3.2.1, Figure 6).

* The cumulative survival a_k = Π_{i≤k} σ(c_i) is scored against the realised
  prefix acceptance 1[accepted ≥ k]: ECE with 20 equal-width bins and an exact
  rank-based AUROC (`calibration_table`).
* Sequential Temperature Scaling (`fit_sts`): one temperature per position,
  fitted left to right by grid search on the ECE of the cumulative product.
* `sts_before_after`: fit on one half of the samples, score the other half
  before and after (the `schedule` command's calibration table, Figure 6).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from .acceptance import as_numpy as _np
from .acceptance import sigmoid as _sigmoid

DEFAULT_STS_GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 200))


def _bin_ids(pred: np.ndarray, n_bins: int) -> np.ndarray:
    return np.clip(np.floor(pred * n_bins).astype(np.int64), 0, n_bins - 1)


def ece(pred, label, n_bins: int = 20) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1].

    ECE = Σ_b (n_b / N) |mean(pred)_b − mean(label)_b| (bins weighted by count; the
    last bin is closed at 1). 20 bins follow the reference's reliability helper
    (DeepSpec's
    deepspec/eval/dspark/confidence_head.py). NaN for empty input.
    """
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(label, dtype=np.float64).ravel()
    if p.size == 0:
        return float("nan")
    b = _bin_ids(p, n_bins)
    sp = np.bincount(b, weights=p, minlength=n_bins)
    sy = np.bincount(b, weights=y, minlength=n_bins)
    return float(np.abs(sp - sy).sum() / p.size)


def _ece_grid(preds: np.ndarray, y: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of preds [G, n] against labels y [n]."""
    G, n = preds.shape
    flat = (_bin_ids(preds, n_bins) + n_bins * np.arange(G)[:, None]).ravel()
    sp = np.bincount(flat, weights=preds.ravel(), minlength=G * n_bins).reshape(G, n_bins)
    sy = np.bincount(flat, weights=np.broadcast_to(y, (G, n)).ravel(), minlength=G * n_bins).reshape(G, n_bins)
    return np.abs(sp - sy).sum(1) / n


def auroc(pred, label) -> float:
    """Exact ROC-AUC via the Mann-Whitney U statistic with average ranks for ties
    (a tied positive/negative pair counts 1/2). NaN if either class is absent.
    (The reference uses a 1000-bin histogram approximation; exact is our choice.)"""
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(label).ravel().astype(bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = rankdata(p)
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def _prep(conf_logits, accepted, proposal_len):
    x = _np(conf_logits)
    A = np.asarray(accepted, dtype=np.int64)
    L = np.asarray(proposal_len, dtype=np.int64)
    if x.ndim != 2 or A.shape != (x.shape[0],) or L.shape != A.shape:
        raise ValueError("expected conf_logits [N, gamma], accepted [N], proposal_len [N]")
    return x, A, L


def _valid(x: np.ndarray, L: np.ndarray, k: int) -> np.ndarray:
    """Rows that proposed position k (1-based) and have finite logits on 1..k."""
    return (L >= k) & np.all(np.isfinite(x[:, :k]), axis=1)


def apply_sts(conf_logits, temps) -> np.ndarray:
    """Calibrated conditional confidences ĉ_k = σ(logit_k / T_k), shape [N, gamma]."""
    return _sigmoid(_np(conf_logits) / np.asarray(temps, dtype=np.float64)[None, :])


def calibration_table(conf_logits, accepted, proposal_len, temperatures=None, n_bins: int = 20) -> pd.DataFrame:
    """Reliability of the cumulative survival per position (Figure 6, paper p. 15).

    For each position k, over rounds with proposal_len ≥ k: pred = Π_{i≤k} ĉ_i
    (ĉ = σ(logit / T), T = 1 unless ``temperatures`` are given, e.g. from
    ``fit_sts``) and label = 1[accepted ≥ k]. Columns: position, ece, auroc, n,
    mean_pred, mean_label.
    """
    x, A, L = _prep(conf_logits, accepted, proposal_len)
    g = x.shape[1]
    temps = np.ones(g) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    surv = np.cumprod(apply_sts(x, temps), axis=1)
    rows = []
    for k in range(1, g + 1):
        m = _valid(x, L, k)
        p, y = surv[m, k - 1], (A[m] >= k).astype(np.float64)
        mp, ml = (float(p.mean()), float(y.mean())) if p.size else (np.nan, np.nan)
        rows.append((k, ece(p, y, n_bins), auroc(p, y), int(m.sum()), mp, ml))
    return pd.DataFrame(rows, columns=["position", "ece", "auroc", "n", "mean_pred", "mean_label"])


def fit_sts(conf_logits, accepted, proposal_len, grid=DEFAULT_STS_GRID, n_bins: int = 20) -> np.ndarray:
    """Sequential Temperature Scaling (paper Sec. 3.2.1). Returns temperatures [gamma].

    For k = 1..gamma in order, T_k is the grid value minimising the ECE of the
    cumulative survival Π_{i≤k} σ(logit_i / T_i) against 1[accepted ≥ k] over rounds
    with proposal_len ≥ k, with T_{<k} fixed at their already-chosen values.
    Scaling by T_k > 0 is order-preserving within a position, so AUROC at k=1 is
    unchanged. Fit on held-out (validation) rounds, not on the evaluation rounds.

    The paper does not specify the grid, the number of ECE bins or the validation
    set: the default grid (200 log-spaced values in [0.05, 20], plus T = 1 so the
    identity is always a candidate) and 20 equal-width bins are our choices.
    A position without valid rounds keeps T_k = 1.
    """
    x, A, L = _prep(conf_logits, accepted, proposal_len)
    grid = np.unique(np.append(np.asarray(grid, dtype=np.float64), 1.0))
    g = x.shape[1]
    temps = np.ones(g)
    for k in range(1, g + 1):
        m = _valid(x, L, k)
        if not m.any():
            continue
        prefix = np.prod(apply_sts(x[m, : k - 1], temps[: k - 1]), axis=1) if k > 1 else np.ones(int(m.sum()))
        y = (A[m] >= k).astype(np.float64)
        chunk = max(1, int(2_000_000 // max(1, y.size)))
        errs = []
        for s in range(0, grid.size, chunk):
            T = grid[s : s + chunk, None]
            errs.append(_ece_grid(prefix[None, :] * _sigmoid(x[m, k - 1][None, :] / T), y, n_bins))
        temps[k - 1] = grid[int(np.argmin(np.concatenate(errs)))]
    return temps


def split_samples(sample_ids, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row masks (fit, held-out): a seeded half/half split by sample id, so
    that the rounds of one sample are never on both sides."""
    sid = np.asarray(sample_ids).astype(str)
    ids = np.array(sorted(set(sid)))
    if ids.size < 2:
        raise ValueError("calibration needs records from at least 2 samples")
    fit_ids = np.random.default_rng(seed).permutation(ids)[: ids.size // 2]
    fit = np.isin(sid, fit_ids)
    return fit, ~fit


def sts_before_after(conf_logits, accepted, proposal_len, fit) -> tuple[pd.DataFrame, np.ndarray]:
    """STS fitted on the rows `fit`, scored on the others: the per-position
    table (position, ece_before, ece_after, auroc, n, temperature, auroc_after)
    and the temperatures."""
    x, A, L = _prep(conf_logits, accepted, proposal_len)
    held = ~np.asarray(fit, dtype=bool)
    temps = fit_sts(x[~held], A[~held], L[~held])
    before = calibration_table(x[held], A[held], L[held])
    after = calibration_table(x[held], A[held], L[held], temperatures=temps)
    table = pd.DataFrame({"position": before["position"], "ece_before": before["ece"], "ece_after": after["ece"],
                          "auroc": before["auroc"], "n": before["n"], "temperature": temps,
                          "auroc_after": after["auroc"]})
    return table, temps

"""Metrics from per-round speculative-decoding records (paper Sec. 4, Table 1, Figs. 2, 5, 6).

Input is a pandas DataFrame with one row per speculative round and columns
``sample_id, round, proposal_len, accepted, emitted, draft_time_s,
verify_time_s`` plus, for DSpark, ``conf_logit_1 .. conf_logit_gamma`` (raw
confidence-head logits, NaN when the drafter has no confidence head).

* tau (Table 1) is the mean of ``emitted`` per round: accepted draft tokens plus
  the bonus/correction token (notes §0.1, Eq. 1). A round that ends on an
  accepted EOS emits no bonus, so emitted == accepted there.
* Confidence intervals are percentile bootstraps that resample *samples*
  (``sample_id``) with replacement, because rounds within a sample are
  correlated. Every bootstrapped quantity is a ratio of sums, so per-sample sums
  are precomputed once and each replicate is a weighted sum (one matrix product).

The verification math itself lives in :mod:`deepspec.sampling`; this module
only reuses ``per_position_acceptance`` and ``expected_tau`` from there.
"""
from __future__ import annotations

import re
import warnings
from typing import Dict, List, Optional

import numpy as np
import pandas as pd
import torch
from scipy.special import expit

from .sampling import expected_tau, per_position_acceptance

CONF_PREFIX = "conf_logit_"


def conf_columns(df: pd.DataFrame) -> List[str]:
    """The ``conf_logit_k`` columns of ``df`` ordered by k (1-based)."""
    cols = [c for c in df.columns if re.fullmatch(CONF_PREFIX + r"\d+", str(c))]
    return sorted(cols, key=lambda c: int(str(c)[len(CONF_PREFIX):]))


def conf_logits(df: pd.DataFrame) -> np.ndarray:
    """Confidence logits as a float array [rounds, gamma] (empty second dim if absent)."""
    cols = conf_columns(df)
    return df[cols].to_numpy(dtype=np.float64) if cols else np.zeros((len(df), 0))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return expit(np.asarray(x, dtype=np.float64))


def _expected_tau_np(c: np.ndarray) -> np.ndarray:
    """sampling.expected_tau on numpy input (float64), over the last dim."""
    return expected_tau(torch.as_tensor(np.asarray(c, dtype=np.float64))).numpy()


def _bootstrap_weights(n_samples: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n_samples] multiplicities of each sample in each resample."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_samples, size=(n_boot, n_samples))
    flat = (idx + n_samples * np.arange(n_boot)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * n_samples).reshape(n_boot, n_samples).astype(np.float64)


def _ratio_ci(num: np.ndarray, den: np.ndarray, w: np.ndarray, alpha: float = 0.05):
    """Percentile CI of sum(num)/sum(den) under resampling weights w [n_boot, S].

    num/den are per-sample sums, shape [S] or [S, K]; returns (low, high) of shape [] or [K].
    """
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no attempts at k
        reps = (w @ num) / (w @ den)
        low = np.nanquantile(reps, alpha / 2, axis=0)
        high = np.nanquantile(reps, 1 - alpha / 2, axis=0)
    return low, high


def _check(df: pd.DataFrame) -> None:
    need = {"sample_id", "proposal_len", "accepted", "emitted"}
    missing = need - set(df.columns)
    if missing:
        raise ValueError(f"records lack columns {sorted(missing)}")
    if len(df) == 0:
        raise ValueError("no rounds in records")


def summarize_rounds(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> Dict[str, float]:
    """Headline numbers of one run (Table 1 tau with a bootstrap 95 % CI).

    Keys: ``n_samples, rounds, tau, tau_ci_low, tau_ci_high, verify_rate,
    draft_accept_rate, tau_selfcheck, mean_draft_time_s, mean_verify_time_s``.

    * ``tau`` = mean(emitted) over all rounds (round-pooled, as in the reference).
    * ``verify_rate`` = Σ emitted / (Σ proposal_len + rounds): tokens kept over
      tokens verified, both counting the bonus slot. This is the acceptance rate
      of Figure 5 (6.11 / 7.95 = 76.9 % at threshold 0, notes §1.5), so the
      numerator includes the bonus token. ``draft_accept_rate`` = Σ accepted /
      Σ proposal_len counts draft tokens only.
    * ``tau_selfcheck`` = expected_tau(c) = 1 + Σ_k Π_{i≤k} c_i with c the measured
      conditional per-position acceptance (Figure 2). For full-length proposals
      without EOS rounds the product telescopes to P(accepted ≥ k), so it equals
      ``tau`` exactly; a gap flags truncated proposals, EOS rounds or a bug.
    """
    _check(df)
    L = df["proposal_len"].to_numpy(np.int64)
    A = df["accepted"].to_numpy(np.int64)
    E = df["emitted"].to_numpy(np.float64)
    rounds = len(df)

    codes, _ = pd.factorize(df["sample_id"])
    S = int(codes.max()) + 1
    sum_e = np.bincount(codes, weights=E, minlength=S)
    n_r = np.bincount(codes, minlength=S).astype(np.float64)
    lo, hi = _ratio_ci(sum_e, n_r, _bootstrap_weights(S, n_boot, seed))

    stats = per_position_acceptance(L, A)
    c = np.nan_to_num(stats.conditional, nan=0.0)
    out = {
        "n_samples": S,
        "rounds": rounds,
        "tau": float(E.mean()),
        "tau_ci_low": float(lo),
        "tau_ci_high": float(hi),
        "verify_rate": float(E.sum() / (L.sum() + rounds)),
        "draft_accept_rate": float(A.sum() / L.sum()) if L.sum() > 0 else float("nan"),
        "tau_selfcheck": float(_expected_tau_np(c)) if c.size else 1.0,
    }
    for col in ("draft_time_s", "verify_time_s"):
        out[f"mean_{col}"] = float(df[col].mean()) if col in df.columns else float("nan")
    return out


def per_sample_position_counts(df: pd.DataFrame, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (attempts, accepted) counts at positions 1..K, each [S, K],
    rows in order of first appearance of sample_id (the Figure 2 numerator and
    denominator before pooling; used for bootstraps over samples)."""
    L = df["proposal_len"].to_numpy(np.int64)
    A = df["accepted"].to_numpy(np.int64)
    codes, _ = pd.factorize(df["sample_id"])
    S = int(codes.max()) + 1
    k = np.arange(1, K + 1)
    att = ((L[:, None] >= k) & (A[:, None] >= k - 1)).astype(np.float64)  # [rounds, K]
    acc = ((L[:, None] >= k) & (A[:, None] >= k)).astype(np.float64)
    att_s = np.zeros((S, K))
    acc_s = np.zeros((S, K))
    np.add.at(att_s, codes, att)
    np.add.at(acc_s, codes, acc)
    return att_s, acc_s


ACCEPT_PROB_PREFIX, ALPHA_PREFIX = "accept_prob_", "alpha_"


def has_rb_columns(df: pd.DataFrame, K: int) -> bool:
    return all(f"{p}{k}" in df.columns for p in (ACCEPT_PROB_PREFIX, ALPHA_PREFIX) for k in range(1, K + 1))


def per_sample_rb_sums(df: pd.DataFrame, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Rao-Blackwellised Figure-2 sums per sample: (expected attempts, expected
    accepted) at positions 1..K, each [S, K] (rows as in per_sample_position_counts).

    Given a round's context and drafted tokens, verification accepts token i
    with probability a_i = min(1, p_t(x_i)/p_d(x_i)) independently of the rest,
    so E[1{1..k-1 accepted}] = w_k = prod_{i<k} a_i, and E[1{1..k accepted}] =
    w_k * alpha_k with alpha_k = E_{x_k ~ p_d}[a_k] = sum_v min(p_d, p_t) (Eq. 8).
    Replacing the two indicators of the count estimator by these conditional
    expectations leaves both sums unbiased, so the ratio estimates the same
    conditional acceptance P(k | 1..k-1) with lower variance; and every round
    that verified position k contributes to it, not only the rounds that got
    that far. Positions not verified (NaN) contribute nothing.
    """
    a = df[[f"{ACCEPT_PROB_PREFIX}{k}" for k in range(1, K + 1)]].to_numpy(np.float64)
    alpha = df[[f"{ALPHA_PREFIX}{k}" for k in range(1, K + 1)]].to_numpy(np.float64)
    seen = np.isfinite(a) & np.isfinite(alpha)
    # w_k = prod_{i<k} a_i, zero once a position is missing
    prev = np.concatenate([np.ones((len(df), 1)), np.where(seen, a, 0.0)[:, :-1]], axis=1)
    w = np.cumprod(prev, axis=1) * seen
    num = w * np.where(seen, alpha, 0.0)
    codes, _ = pd.factorize(df["sample_id"])
    S = int(codes.max()) + 1
    w_s, num_s = np.zeros((S, K)), np.zeros((S, K))
    np.add.at(w_s, codes, w)
    np.add.at(num_s, codes, num)
    return w_s, num_s


def bootstrap_weights(n_samples: int, n_boot: int, seed: int) -> np.ndarray:
    """Public alias: [n_boot, n_samples] resampling multiplicities."""
    return _bootstrap_weights(n_samples, n_boot, seed)


def position_table(
    df: pd.DataFrame, *, gamma: Optional[int] = None, n_boot: int = 1000, seed: int = 0
) -> pd.DataFrame:
    """Per-position acceptance (paper Figure 2) with bootstrap CIs over samples.

    Columns: ``position`` (1..gamma), ``attempts`` (rounds that proposed ≥ k and
    accepted 1..k-1), ``accepted`` (of those, rounds that accepted k),
    ``acceptance`` = accepted / attempts, the *conditional* rate
    P(k accepted | 1..k-1 accepted) of Figure 2 (notes §0.4), ``ci_low``/``ci_high``
    (95 % percentile bootstrap over sample_id) and ``survival`` = P(accepted ≥ k |
    proposed ≥ k), the unconditional rate the reference prints as accept_rate@k-1.
    With the per-position ``accept_prob_k``/``alpha_k`` columns it adds the
    Rao-Blackwellised estimate of the same conditional rate
    (``per_sample_rb_sums``): ``expected_attempts`` (sum of w_k),
    ``acceptance_rb``, ``rb_ci_low``/``rb_ci_high``; NaN without those columns.
    """
    _check(df)
    L = df["proposal_len"].to_numpy(np.int64)
    A = df["accepted"].to_numpy(np.int64)
    K = int(gamma if gamma is not None else L.max())
    stats = per_position_acceptance(L, A, max_position=K)

    att_s, acc_s = per_sample_position_counts(df, K)
    bw = _bootstrap_weights(att_s.shape[0], n_boot, seed)
    lo, hi = _ratio_ci(acc_s, att_s, bw)
    out = {
        "position": stats.position,
        "attempts": stats.attempts,
        "accepted": stats.accepted,
        "acceptance": stats.conditional,
        "ci_low": np.broadcast_to(lo, (K,)),
        "ci_high": np.broadcast_to(hi, (K,)),
        "survival": stats.survival,
    }
    nan = np.full(K, np.nan)
    if has_rb_columns(df, K):
        w_s, num_s = per_sample_rb_sums(df, K)
        rlo, rhi = _ratio_ci(num_s, w_s, bw)
        with np.errstate(invalid="ignore", divide="ignore"):
            rb = np.where(w_s.sum(0) > 0, num_s.sum(0) / w_s.sum(0), np.nan)
        out.update(expected_attempts=w_s.sum(0), acceptance_rb=rb, rb_ci_low=rlo, rb_ci_high=rhi)
    else:
        out.update(expected_attempts=nan, acceptance_rb=nan, rb_ci_low=nan, rb_ci_high=nan)
    return pd.DataFrame(out)


def confidence_selfcheck(df: pd.DataFrame) -> Dict[str, float]:
    """Predicted vs measured tau from the confidence head (Eq. 7 + expected-tau identity).

    Per round, predicted tau = 1 + Σ_{k ≤ proposal_len} Π_{i≤k} σ(conf_logit_i),
    i.e. expected_tau of the head's conditional probabilities over the tokens that
    were actually proposed; averaged over rounds whose logits are all finite on
    the proposed prefix. ``measured_tau`` is mean(emitted) over the same rounds.
    Returns NaNs (and n_rounds 0) when no confidence logits are present.
    """
    _check(df)
    logits = conf_logits(df)
    nan = {"predicted_tau": float("nan"), "measured_tau": float("nan"), "n_rounds": 0}
    if logits.shape[1] == 0:
        return nan
    L = df["proposal_len"].to_numpy(np.int64)
    inside = np.arange(1, logits.shape[1] + 1)[None, :] <= L[:, None]
    ok = ~np.any(inside & ~np.isfinite(logits), axis=1) & np.any(np.isfinite(logits), axis=1)
    if not ok.any():
        return nan
    p = np.where(inside, _sigmoid(np.nan_to_num(logits)), 0.0)[ok]
    pred = _expected_tau_np(p)
    return {
        "predicted_tau": float(pred.mean()),
        "measured_tau": float(df["emitted"].to_numpy(np.float64)[ok].mean()),
        "n_rounds": int(ok.sum()),
    }

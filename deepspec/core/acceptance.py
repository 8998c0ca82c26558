"""Accepted length and per-position acceptance from per-round records (paper
Sec. 4: Table 1's tau, Figure 2's conditional acceptance with its count and
Rao-Blackwellised estimators, their bootstrap intervals, the confidence self-check).

Input is a pandas DataFrame with one row per speculative round and columns
``sample_id, round, proposal_len, accepted, emitted, draft_time_s,
verify_time_s`` plus, for DSpark, ``conf_logit_1 .. conf_logit_gamma`` (raw
confidence-head logits, NaN when the drafter has no confidence head).

* tau (Table 1) is the mean of ``emitted`` per round: accepted draft tokens plus
  the bonus/correction token (paper footnote 3, Eq. 1). A round that ends on an
  accepted EOS emits no bonus, so emitted == accepted there.
* Confidence intervals are percentile bootstraps that resample *samples*
  (``sample_id``) with replacement, because rounds within a sample are
  correlated. Every bootstrapped quantity is a ratio of sums, so per-sample sums
  are precomputed once and each replicate is a weighted sum (one matrix product).

The verification math itself lives in :mod:`deepspec.core.verify`; this module
only reuses ``expected_tau`` from there.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from scipy.special import expit

from .verify import expected_tau

CONF_PREFIX = "conf_logit_"


def conf_columns(df: pd.DataFrame) -> List[str]:
    """The ``conf_logit_k`` columns of ``df`` ordered by k (1-based)."""
    cols = [c for c in df.columns if re.fullmatch(CONF_PREFIX + r"\d+", str(c))]
    return sorted(cols, key=lambda c: int(str(c)[len(CONF_PREFIX):]))


def conf_logits(df: pd.DataFrame) -> np.ndarray:
    """Confidence logits as a float array [rounds, gamma] (empty second dim if absent)."""
    cols = conf_columns(df)
    return df[cols].to_numpy(dtype=np.float64) if cols else np.zeros((len(df), 0))


def as_numpy(x) -> np.ndarray:
    """float64 numpy copy of an array-like or a (detached, CPU) tensor."""
    return np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)


def sigmoid(x) -> np.ndarray:
    return expit(as_numpy(x))


def _expected_tau_np(c: np.ndarray) -> np.ndarray:
    """verify.expected_tau on numpy input (float64), over the last dim."""
    return expected_tau(torch.as_tensor(np.asarray(c, dtype=np.float64))).numpy()


def bootstrap_weights(n_samples: int, n_boot: int, seed: int) -> np.ndarray:
    """[n_boot, n_samples] multiplicities of each sample in each resample."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_samples, size=(n_boot, n_samples))
    flat = (idx + n_samples * np.arange(n_boot)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * n_samples).reshape(n_boot, n_samples).astype(np.float64)


def pooled_ratio(groups: Sequence[tuple], alpha: float = 0.05):
    """A ratio of sums and its percentile bootstrap interval, averaged over groups.

    ``groups`` are (num, den, w): per-sample sums num/den of shape [S] or [S, K]
    and resampling multiplicities w [n_boot, S] (`bootstrap_weights`). The
    estimate is the unweighted mean over groups of sum(num)/sum(den) (one group:
    the plain ratio; several: the paper's average over a domain's benchmarks);
    each bootstrap replicate averages the groups' replicate ratios the same way.
    Ratios with a zero denominator are NaN and left out of the means. Returns
    (estimate, low, high), each of shape [] or [K].
    """
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no attempts at k
        est = np.nanmean(np.stack([num.sum(0) / den.sum(0) for num, den, _ in groups]), 0)
        reps = np.nanmean(np.stack([(w @ num) / (w @ den) for num, den, w in groups]), 0)
        low = np.nanquantile(reps, alpha / 2, axis=0)
        high = np.nanquantile(reps, 1 - alpha / 2, axis=0)
    return est, low, high


@dataclass
class PositionStats:
    position: np.ndarray  # 1..K
    attempts: np.ndarray  # rounds that proposed >= k tokens and accepted 1..k-1
    accepted: np.ndarray  # of those, rounds that also accepted k
    conditional: np.ndarray  # accepted / attempts (paper Figure 2)
    proposed: np.ndarray  # rounds that proposed >= k tokens
    survival: np.ndarray  # P(accepted >= k | proposed >= k) (reference accept_rate@k-1)


def position_indicators(proposal_len, accepted, K: int):
    """Per round and position k = 1..K, the count estimator's indicators, each
    [rounds, K] bool: proposed (the round drafted k), attempted (drafted k and
    accepted 1..k-1: k was verified) and accepted (accepted 1..k)."""
    L = np.asarray(proposal_len, dtype=np.int64)
    A = np.asarray(accepted, dtype=np.int64)
    if L.shape != A.shape:
        raise ValueError("proposal_len and accepted must have the same length")
    if np.any(A > L) or np.any(A < 0):
        raise ValueError("accepted must lie in [0, proposal_len] for every round")
    k = np.arange(1, K + 1)
    proposed = L[:, None] >= k
    return proposed, proposed & (A[:, None] >= k - 1), proposed & (A[:, None] >= k)


def per_position_acceptance(
    proposal_len: Sequence[int], accepted: Sequence[int], max_position: Optional[int] = None
) -> PositionStats:
    """Per-position acceptance from per-round records (proposal length, accepted count)."""
    L = np.asarray(proposal_len, dtype=np.int64)
    K = int(max_position if max_position is not None else (L.max() if L.size else 0))
    proposed, attempted, acc = (x.sum(0) for x in position_indicators(L, accepted, K))
    with np.errstate(invalid="ignore", divide="ignore"):
        conditional = np.where(attempted > 0, acc / np.maximum(attempted, 1), np.nan)
        survival = np.where(proposed > 0, acc / np.maximum(proposed, 1), np.nan)
    return PositionStats(np.arange(1, K + 1), attempted, acc, conditional, proposed, survival)


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
      of Figure 5 (6.11 / 7.95 = 76.9 % at threshold 0, paper p. 15), so the
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
    _, lo, hi = pooled_ratio([(sum_e, n_r, bootstrap_weights(S, n_boot, seed))])

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


def _per_sample(df: pd.DataFrame, *per_round: np.ndarray) -> list[np.ndarray]:
    """Sums of per-round arrays [rounds, K] per sample_id, rows in order of
    first appearance: [S, K] each."""
    codes, _ = pd.factorize(df["sample_id"])
    S = int(codes.max()) + 1
    out = []
    for x in per_round:
        acc = np.zeros((S, x.shape[1]))
        np.add.at(acc, codes, x.astype(np.float64))
        out.append(acc)
    return out


def per_sample_position_counts(df: pd.DataFrame, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (attempts, accepted) counts at positions 1..K, each [S, K]
    (the Figure 2 count estimate's denominator and numerator before pooling)."""
    _, attempted, accepted = position_indicators(df["proposal_len"], df["accepted"], K)
    att_s, acc_s = _per_sample(df, attempted, accepted)
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
    w_s, num_s = _per_sample(df, w, num)
    return w_s, num_s


def position_table(
    df: pd.DataFrame, *, gamma: Optional[int] = None, n_boot: int = 1000, seed: int = 0
) -> pd.DataFrame:
    """Per-position acceptance (paper Figure 2) with bootstrap CIs over samples.

    Columns: ``position`` (1..gamma), ``attempts`` (rounds that proposed ≥ k and
    accepted 1..k-1), ``accepted`` (of those, rounds that accepted k),
    ``acceptance`` = accepted / attempts, the *conditional* rate
    P(k accepted | 1..k-1 accepted) of Figure 2 (paper p. 12), ``ci_low``/``ci_high``
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
    bw = bootstrap_weights(att_s.shape[0], n_boot, seed)
    _, lo, hi = pooled_ratio([(acc_s, att_s, bw)])
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
        rb, rlo, rhi = pooled_ratio([(num_s, w_s, bw)])
        out.update(expected_attempts=w_s.sum(0), acceptance_rb=rb, rb_ci_low=rlo, rb_ci_high=rhi)
    else:
        out.update(expected_attempts=nan, acceptance_rb=nan, rb_ci_low=nan, rb_ci_high=nan)
    return pd.DataFrame(out)


def domain_position_table(records: Sequence[pd.DataFrame], gamma: int, *, n_boot: int = 1000,
                          seed: int = 0) -> pd.DataFrame:
    """Figure 2 for one domain: each benchmark's conditional acceptance averaged
    without weights over the domain's benchmarks (as the paper does), with the
    bootstrap interval of that average (samples resampled within each
    benchmark, benchmark i with seed + i). Both estimators use the same
    resamples; the Rao-Blackwellised columns need every benchmark's
    per-position probabilities and are NaN otherwise. Columns: position,
    attempts, accepted (pooled counts), acceptance, ci_low, ci_high,
    expected_attempts, acceptance_rb, rb_ci_low, rb_ci_high, and survival: the
    unconditional P(accepted >= k | proposed >= k) (the reference's, vLLM's and
    speculators' accept_rate@k-1), averaged over the benchmarks like the rest."""
    count, rb = [], []
    for i, df in enumerate(records):
        att, acc = per_sample_position_counts(df, gamma)
        w = bootstrap_weights(att.shape[0], n_boot, seed + i)
        count.append((acc, att, w))
        if has_rb_columns(df, gamma):
            ew, num = per_sample_rb_sums(df, gamma)
            rb.append((num, ew, w))
    rate, lo, hi = pooled_ratio(count)
    nan = np.full(gamma, np.nan)
    every = len(rb) == len(records)
    surv = np.vstack([per_position_acceptance(df["proposal_len"], df["accepted"], gamma).survival for df in records])
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN positions stay NaN
        survival = np.nanmean(surv, 0)
    rb_rate, rb_lo, rb_hi = pooled_ratio(rb) if every else (nan, nan, nan)
    return pd.DataFrame({
        "position": np.arange(1, gamma + 1),
        "attempts": sum(att.sum(0) for _, att, _ in count).astype(np.int64),
        "accepted": sum(acc.sum(0) for acc, _, _ in count).astype(np.int64),
        "acceptance": rate, "ci_low": lo, "ci_high": hi,
        "expected_attempts": sum(ew.sum(0) for _, ew, _ in rb) if every else nan,
        "acceptance_rb": rb_rate, "rb_ci_low": rb_lo, "rb_ci_high": rb_hi,
        "survival": survival,
    })


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
    p = np.where(inside, sigmoid(np.nan_to_num(logits)), 0.0)[ok]
    pred = _expected_tau_np(p)
    return {
        "predicted_tau": float(pred.mean()),
        "measured_tau": float(df["emitted"].to_numpy(np.float64)[ok].mean()),
        "n_rounds": int(ok.sum()),
    }


# ---------------------------------------------------------------- paired contrasts


def _ids(df: pd.DataFrame) -> np.ndarray:
    """The sample ids in the row order of `_per_sample`'s sums."""
    return pd.factorize(df["sample_id"])[1].to_numpy()


def sample_sums(df: pd.DataFrame, kind: str, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample ids [S], numerator [S, K'], denominator [S, K']) per sample of
    one benchmark's records: ``rb`` (Figure 2, Rao-Blackwellised, K' = K),
    ``count`` (Figure 2, accepted / attempts) or ``tau`` (emitted / rounds, K' = 1)."""
    _check(df)
    if kind == "rb":
        den, num = per_sample_rb_sums(df, K)
    elif kind == "count":
        den, num = per_sample_position_counts(df, K)
    elif kind == "tau":
        num, den = _per_sample(df, df[["emitted"]].to_numpy(np.float64), np.ones((len(df), 1)))
    else:
        raise ValueError(f"unknown kind {kind!r}: rb, count or tau")
    return _ids(df), num, den


def paired_replicates(records: Dict[str, Sequence[pd.DataFrame]], kind: str, K: int, *, n_boot: int = 1000,
                      seed: int = 0) -> Dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per method, (estimate [K'], bootstrap replicates [n_boot, K']) of a
    ratio of sums (`sample_sums`) averaged without weights over benchmarks, with
    the SAME resamples of prompts for every method: ``records[method][i]`` is
    benchmark i's records, and benchmark i's prompts (the union of the sample
    ids of all methods, a prompt a method has no rounds for counting zero) are
    resampled with seed + i. Differences of two methods' replicates are then
    a paired bootstrap over prompts, and differences of two positions of one
    method a bootstrap of that contrast."""
    methods = list(records)
    n_bench = {len(v) for v in records.values()}
    if len(n_bench) != 1:
        raise ValueError("paired_replicates: every method needs the same benchmarks")
    est, reps = {m: [] for m in methods}, {m: [] for m in methods}
    for i in range(n_bench.pop()):
        sums = {m: sample_sums(records[m][i], kind, K) for m in methods}
        union = np.array(sorted(set().union(*(set(s[0].tolist()) for s in sums.values()))), dtype=object)
        w = bootstrap_weights(len(union), n_boot, seed + i)
        for m, (ids, num, den) in sums.items():
            pos = pd.Index(union).get_indexer(ids)
            full_num, full_den = np.zeros((len(union), num.shape[1])), np.zeros((len(union), den.shape[1]))
            full_num[pos], full_den[pos] = num, den
            with np.errstate(invalid="ignore", divide="ignore"):
                est[m].append(full_num.sum(0) / full_den.sum(0))
                reps[m].append((w @ full_num) / (w @ full_den))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # positions no benchmark reached stay NaN
        return {m: (np.nanmean(np.stack(est[m]), 0), np.nanmean(np.stack(reps[m]), 0)) for m in methods}


def contrast(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], alpha: float = 0.05):
    """Estimate and percentile interval of a - b, where a and b are
    (estimate, replicates) from the same resamples (`paired_replicates`;
    scalars or one column each)."""
    d = np.asarray(a[0] - b[0], dtype=np.float64).reshape(())
    r = np.asarray(a[1] - b[1], dtype=np.float64).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(d), float(np.nanquantile(r, alpha / 2)), float(np.nanquantile(r, 1 - alpha / 2))

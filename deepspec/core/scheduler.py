"""How many draft tokens to verify: DSpark's verify-smarter side.

* Static threshold truncation (Figure 5, paper p. 15): the reference cuts each
  proposal at the first position whose *per-position* confidence σ(c_k) falls
  below the threshold; `threshold_sweep` replays it offline on records.
* Algorithm 1 (Sec. 3.2.2): the hardware-aware prefix scheduler that
  maximises Θ = τ·SPS(B) over a batch of requests, plus SPS profiling and an
  offline simulator.

The confidences it consumes are calibrated by `deepspec.core.calibration` (STS).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch

from .acceptance import as_numpy as _np
from .acceptance import conf_logits as _conf_logits
from .acceptance import sigmoid as _sigmoid

SPSLike = Union[Callable[[int], float], Dict[int, float], Sequence[float], np.ndarray]


# --------------------------------------------------------------------------- truncation
def truncate_by_threshold(conf_probs, threshold: float):
    """Proposal lengths under a static confidence threshold (reference rule,
    DeepSpec's deepspec/eval/dspark/draft_ops.py).

    ``conf_probs`` [..., gamma] are per-position probabilities σ(c_k) (numpy or
    torch). The length is the 0-based index of the first position with
    σ(c_k) < threshold, i.e. positions 1..k-1 are kept; gamma if none falls below.
    threshold ≤ 0 keeps everything. Returns int lengths [...] of the input's kind.
    """
    p = _np(conf_probs)
    below = p < threshold if threshold > 0 else np.zeros(p.shape, dtype=bool)
    out = np.where(below.any(-1), below.argmax(-1), p.shape[-1]).astype(np.int64)
    return torch.as_tensor(out, device=conf_probs.device) if isinstance(conf_probs, torch.Tensor) else out


SWEEP_THRESHOLDS = tuple(np.round(np.arange(0, 1.0, 0.1), 1))  # Figure 5's 0.0, 0.1, ..., 0.9


def threshold_sweep(df: pd.DataFrame, thresholds=SWEEP_THRESHOLDS) -> pd.DataFrame:
    """Offline Figure-5 sweep from full-proposal records with confidence logits.

    Per round and threshold: L' = min(truncate(σ(logits)), proposal_len) and
    accepted' = min(accepted, L') (chain verification of a prefix accepts the
    same prefix). Per step (round) we count, as in Figure 5 (bonus included):

    * ``proposed`` = L' + 1 (verify width: the draft tokens plus the bonus slot);
    * ``accepted`` = accepted' + 1 (kept tokens incl. bonus/correction), except in
      a round that ended on an accepted EOS (emitted == accepted) whose EOS is
      still inside L': that round emits no bonus, so accepted' only.

    ``proposed`` uses the recorded ``proposal_len`` (for an EOS round the decode
    loop may record the effective length, which is why the paper's total is 7.95
    not 8). Returns columns threshold, accepted, proposed (means per round),
    acceptance_rate = Σaccepted/Σproposed, n_rounds. At threshold 0 ``accepted``
    equals the measured τ and ``acceptance_rate`` equals ``verify_rate``.
    Rounds whose logits are not finite on the proposed prefix are dropped.
    """
    logits = _conf_logits(df)
    if logits.shape[1] == 0:
        raise ValueError("threshold_sweep needs conf_logit_k columns")
    L = df["proposal_len"].to_numpy(np.int64)
    A = df["accepted"].to_numpy(np.int64)
    E = df["emitted"].to_numpy(np.int64)
    inside = np.arange(1, logits.shape[1] + 1)[None, :] <= L[:, None]
    ok = ~np.any(inside & ~np.isfinite(logits), axis=1)
    L, A, E, probs = L[ok], A[ok], E[ok], _sigmoid(np.nan_to_num(logits[ok], nan=np.inf))
    eos = E == A
    rows = []
    for thr in np.asarray(thresholds, dtype=np.float64):
        Lp = np.minimum(truncate_by_threshold(probs, float(thr)), L)
        Ap = np.minimum(A, Lp)
        acc = Ap + 1 - (eos & (Ap == A)).astype(np.int64)
        prop = Lp + 1
        rows.append((float(thr), acc.mean(), prop.mean(), acc.sum() / prop.sum(), int(ok.sum())))
    return pd.DataFrame(rows, columns=["threshold", "accepted", "proposed", "acceptance_rate", "n_rounds"])


# --------------------------------------------------------------------------- Algorithm 1
def sps_fn(sps: SPSLike) -> Callable[[int], float]:
    if callable(sps):
        return lambda B: float(sps(int(B)))
    if isinstance(sps, dict):
        return lambda B: float(sps[int(B)])
    arr = np.asarray(sps, dtype=np.float64)
    return lambda B: float(arr[int(B)])


def schedule_prefix(c, sps: SPSLike, early_stop: bool = True) -> Tuple[np.ndarray, float]:
    """Algorithm 1: hardware-aware prefix scheduling (paper Sec. 3.2.2).

    ``c`` [R, gamma] are conditional acceptance probabilities (calibrated
    confidences); ``sps`` maps the forward batch size B (tokens) to engine steps/s
    (a callable such as ``SPSCurve``, a dict, or an array indexed by B).

    With a_{r,j} = Π_{i≤j} c_{r,i}, candidates (r, j) with a > 0 are visited in
    descending a (ties: smaller j first, then smaller r, so j-1 precedes j).
    Starting from ℓ = 0, B = R, τ* = R, Θ_best = R·SPS(R), each candidate sets
    ℓ_r = j, B += 1, τ* += a and Θ = τ*·SPS(B); a strict improvement records ℓ,
    otherwise the scan stops (``early_stop=True``, non-anticipating, paper Appendix A).
    ``early_stop=False`` scans all candidates (the retrospective / production
    variant, Appendix A and Sec. 5.2); since the top-m greedy prefix maximises τ
    for each B, its result is the exact optimum of Θ over all ℓ with
    ℓ_r ≤ #{j : a_{r,j} > 0} (positions with a = 0 are never proposed).
    Returns (lengths [R] int64, Θ_best).
    """
    c = np.clip(np.nan_to_num(_np(c), nan=0.0), 0.0, 1.0)
    if c.ndim != 2:
        raise ValueError("c must be [R, gamma]")
    R = c.shape[0]
    f = sps_fn(sps)
    a = np.cumprod(c, axis=1)
    r_idx, j_idx = np.nonzero(a > 0)
    vals = a[r_idx, j_idx]
    order = np.lexsort((r_idx, j_idx, -vals))
    r_sorted, vals = r_idx[order], vals[order]

    best, best_m = R * f(R), 0
    tau = float(R)
    for m in range(1, vals.size + 1):
        tau += vals[m - 1]
        theta = tau * f(R + m)
        if theta > best:
            best, best_m = theta, m
        elif early_stop:
            break
    lengths = np.bincount(r_sorted[:best_m], minlength=R).astype(np.int64)
    return lengths, float(best)


@dataclass
class SPSCurve:
    """Profiled throughput curve SPS(B): target forward steps per second at batch B tokens.

    ``__call__`` interpolates linearly between profiled points and holds the
    end values outside the profiled range.
    """

    batch_tokens: np.ndarray
    steps_per_s: np.ndarray

    def __post_init__(self):
        b = np.asarray(self.batch_tokens, dtype=np.float64)
        s = np.asarray(self.steps_per_s, dtype=np.float64)
        if b.shape != s.shape or b.ndim != 1 or b.size == 0:
            raise ValueError("batch_tokens and steps_per_s must be equal-length 1-D arrays")
        o = np.argsort(b)
        self.batch_tokens, self.steps_per_s = b[o], s[o]

    def __call__(self, B):
        out = np.interp(np.asarray(B, dtype=np.float64), self.batch_tokens, self.steps_per_s)
        return float(out) if np.ndim(out) == 0 else out

    @classmethod
    def from_csv(cls, path) -> "SPSCurve":
        d = pd.read_csv(path)
        return cls(d["batch_tokens"].to_numpy(), d["steps_per_s"].to_numpy())

    def to_csv(self, path) -> None:
        pd.DataFrame({"batch_tokens": self.batch_tokens, "steps_per_s": self.steps_per_s}).to_csv(path, index=False)


def profile_sps(
    forward_fn: Callable[[int], object],
    batch_sizes: Sequence[int],
    n_warmup: int = 1,
    n_iter: int = 3,
    sync: Optional[Callable[[], None]] = None,
) -> SPSCurve:
    """Time ``forward_fn(B)`` (one target forward over B tokens) for each B.

    SPS(B) = n_iter / elapsed (time.perf_counter), after ``n_warmup`` untimed
    calls. Pass ``sync`` (e.g. torch.cuda.synchronize) for asynchronous devices;
    it is called before starting and before stopping the clock.
    """
    sps = []
    for B in batch_sizes:
        for _ in range(n_warmup):
            forward_fn(int(B))
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(n_iter):
            forward_fn(int(B))
        if sync:
            sync()
        sps.append(n_iter / max(time.perf_counter() - t0, 1e-12))
    return SPSCurve(np.asarray(batch_sizes), np.asarray(sps))


def simulate_schedule(c, accepted, sps: SPSLike, batch: int, seed: int = 0, early_stop: bool = True) -> Dict[str, float]:
    """Offline comparison of Algorithm 1 against fixed full-length verification.

    The N requests (rows of ``c`` [N, gamma], conditional acceptance probabilities
    given to the scheduler, and ``accepted`` [N], realised accepted counts of a
    full proposal) are shuffled with ``seed`` and split into floor(N / batch)
    steps of ``batch`` requests. Per step, Algorithm 1 picks ℓ and the realised
    tokens are τ = Σ_r (1 + min(accepted_r, ℓ_r)) at B = Σ_r (1 + ℓ_r) (a verified
    prefix accepts what the full proposal accepted, up to its length). Fixed
    verification uses ℓ = γ. Θ is aggregated as Σ τ / Σ 1/SPS(B) (tokens per
    second over all steps; for one step this is τ·SPS(B)).
    Keys: theta_alg1, theta_fixed, theta_nospec (ℓ = 0), speedup_vs_fixed,
    theta_alg1_predicted (with the scheduler's own τ*), mean_verify_len (mean ℓ),
    mean_batch_tokens, tau_alg1, tau_fixed (per request per step), n_steps.
    """
    c = np.asarray(c, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.int64)
    N, g = c.shape
    if acc.shape != (N,) or batch < 1 or N < batch:
        raise ValueError("need accepted [N] and N >= batch >= 1")
    f = sps_fn(sps)
    perm = np.random.default_rng(seed).permutation(N)
    n_steps = N // batch
    tok = {"alg1": 0.0, "fixed": 0.0, "nospec": 0.0}
    tim = dict.fromkeys(tok, 0.0)
    pred_tok, lens, Bs = 0.0, [], []
    for s in range(n_steps):
        idx = perm[s * batch : (s + 1) * batch]
        ell, theta = schedule_prefix(c[idx], f, early_stop=early_stop)
        B = batch + int(ell.sum())
        for name, l, b in (("alg1", ell, B), ("fixed", np.full(batch, g), batch * (1 + g)), ("nospec", 0, batch)):
            tok[name] += float(np.sum(1 + np.minimum(acc[idx], l)))
            tim[name] += 1.0 / f(b)
        pred_tok += theta / f(B)
        lens.append(ell)
        Bs.append(B)
    th = {k: tok[k] / tim[k] for k in tok}
    return {
        "theta_alg1": th["alg1"],
        "theta_fixed": th["fixed"],
        "theta_nospec": th["nospec"],
        "speedup_vs_fixed": th["alg1"] / th["fixed"],
        "theta_alg1_predicted": pred_tok / tim["alg1"],
        "mean_verify_len": float(np.concatenate(lens).mean()),
        "mean_batch_tokens": float(np.mean(Bs)),
        "tau_alg1": tok["alg1"] / (n_steps * batch),
        "tau_fixed": tok["fixed"] / (n_steps * batch),
        "n_steps": n_steps,
    }

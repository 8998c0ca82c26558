"""The paper's qualitative claims (Sec. 4.3.1 and Figure 2; Table 1), each
judged on our records by the 95 % interval of a difference: a paired
bootstrap over prompts (`core.acceptance.paired_replicates`: every method's
rates recomputed on the same resampled prompts), so "holds" means the
interval excludes 0 on the claimed side.

  suffix decay   DFlash's conditional acceptance at position 1 above position 3,
                 in at least 2 of the 3 domains
  stability      DSpark above DFlash at positions 2 and 3 in every judged domain
  macro tau      DSpark's macro tau above DFlash's (mean over benchmarks)
  position 1     DSpark's and DFlash's position-1 acceptance >= 0.3 in Math and
                 Code (the estimate; below it a drafter is undertrained and the
                 curves say little about the drafting paradigm)
  Eagle3 shape   Eagle3 below DFlash at position 1, and not falling from
                 position 1 to 3 (flat or rising), in every judged domain

A (domain, position) is judged only where each method involved has at least
MIN_ATTEMPTS (expected) attempts there, pooled over the domain's benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import paper
from ..core.acceptance import contrast, has_rb_columns, paired_replicates, sample_sums

MIN_ATTEMPTS = 30
P1_AIM = 0.3


@dataclass
class Claim:
    name: str               # a few words, for the figure
    holds: Optional[bool]   # None: not judged (too few attempts or a drafter missing)
    text: str               # the REPORT.md line


def _fmt(c) -> str:
    d, lo, hi = c
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def verdict(holds: Optional[bool]) -> str:
    return {True: "holds", False: "does not hold", None: "not judged"}[holds]


class _Rates:
    """Paired replicates of every method's per-position rates per domain, and of macro tau."""

    def __init__(self, records: dict, K: int, n_boot: int, seed: int):
        dfs = [df for by_domain in records.values() for recs in by_domain.values() for df in recs]
        self.kind = "rb" if all(has_rb_columns(df, K) for df in dfs) else "count"
        self.methods = list(records)
        self.domains = [d for d in ("Math", "Code", "Chat") if d in next(iter(records.values()))]
        self.pos, self.attempts = {}, {}
        for d in self.domains:
            by_m = {m: records[m][d] for m in self.methods}
            self.pos[d] = paired_replicates(by_m, self.kind, K, n_boot=n_boot, seed=seed)
            self.attempts[d] = {m: sum(sample_sums(df, self.kind, K)[2].sum(0) for df in by_m[m]) for m in self.methods}
        every = {m: [df for d in self.domains for df in records[m][d]] for m in self.methods}
        self.tau = paired_replicates(every, "tau", K, n_boot=n_boot, seed=seed)

    def at(self, m: str, d: str, k: int):
        est, reps = self.pos[d][m]
        return est[k - 1], reps[:, k - 1]

    def judged(self, d: str, k: int, *methods: str) -> bool:
        return all(m in self.methods and self.attempts[d][m][k - 1] >= MIN_ATTEMPTS for m in methods)

    def interval(self, m: str, d: str, k: int):
        est, reps = self.at(m, d, k)
        return est, float(np.nanquantile(reps, 0.025)), float(np.nanquantile(reps, 0.975))


def _suffix_decay(r: _Rates) -> Claim:
    parts, n_hold, n_judged = [], 0, 0
    for d in r.domains:
        if not r.judged(d, 3, "dflash"):
            parts.append(f"{d} not judged")
            continue
        c = contrast(r.at("dflash", d, 1), r.at("dflash", d, 3))
        n_judged, n_hold = n_judged + 1, n_hold + (c[1] > 0)
        parts.append(f"{d} {_fmt(c)} {'holds' if c[1] > 0 else 'does not hold'}")
    holds = None if n_judged < 2 else n_hold >= 2
    return Claim("DFlash decay p1 > p3", holds,
                 f"DFlash suffix decay, position 1 minus position 3: {'; '.join(parts)}. "
                 f"{verdict(holds).capitalize()} ({n_hold} of {n_judged} judged domains; the claim needs 2 of 3).")


def _stability(r: _Rates) -> Claim:
    parts, ok = [], []
    for d in r.domains:
        for k in (2, 3):
            if r.judged(d, k, "dspark", "dflash"):
                c = contrast(r.at("dspark", d, k), r.at("dflash", d, k))
                ok.append(c[1] > 0)
                parts.append(f"{d} p{k} {_fmt(c)}")
            else:
                parts.append(f"{d} p{k} not judged")
    holds = all(ok) if ok else None
    return Claim("DSpark > DFlash at p2, p3", holds,
                 f"DSpark minus DFlash at positions 2 and 3: {'; '.join(parts)}. {verdict(holds).capitalize()} "
                 f"({sum(ok)} of {len(ok)} judged points exclude 0; the claim needs all).")


def _macro_tau(r: _Rates, base: str) -> Optional[Claim]:
    if not {"dspark", base} <= set(r.methods):
        return None
    c = contrast(r.tau["dspark"], r.tau[base])
    gain = c[0] / float(np.asarray(r.tau[base][0]).reshape(()))
    label = paper.METHOD_LABEL[base]
    return Claim(f"DSpark tau > {label}", c[1] > 0,
                 f"DSpark macro τ minus {label}'s: {_fmt(c)} ({gain:+.1%}; paper, {paper.FIG2_TARGET}: "
                 f"{100 * paper.macro_gain(paper.FIG2_TARGET, 'dspark', base):+.1f} %). {verdict(c[1] > 0).capitalize()}.")


def _position_one(r: _Rates) -> Claim:
    parts, ok = [], []
    for m in ("dspark", "dflash"):
        for d in ("Math", "Code"):
            if m in r.methods and d in r.domains and r.judged(d, 1, m):
                est, lo, hi = r.interval(m, d, 1)
                ok.append(est >= P1_AIM)
                parts.append(f"{paper.METHOD_LABEL[m]} {d} {est:.3f} [{lo:.3f}, {hi:.3f}]")
    holds = all(ok) if ok else None
    return Claim(f"p1 >= {P1_AIM}", holds,
                 f"Position-1 acceptance of DSpark and DFlash in Math and Code, against the aim {P1_AIM}: "
                 f"{'; '.join(parts) or 'not judged'}. {verdict(holds).capitalize()}.")


def _eagle3_shape(r: _Rates) -> Claim:
    parts, ok = [], []
    for d in r.domains:
        if not (r.judged(d, 1, "eagle3", "dflash") and r.judged(d, 3, "eagle3")):
            parts.append(f"{d} not judged")
            continue
        low = contrast(r.at("eagle3", d, 1), r.at("dflash", d, 1))
        after = contrast(r.at("eagle3", d, 3), r.at("eagle3", d, 1))
        shape = "rising" if after[1] > 0 else "falling" if after[2] < 0 else "flat"
        ok.append(low[2] < 0 and shape != "falling")
        parts.append(f"{d}: p1 minus DFlash's {_fmt(low)}, p3 minus p1 {_fmt(after)} ({shape})")
    holds = all(ok) if ok else None
    return Claim("Eagle3 low at p1, then flat/rising", holds,
                 f"Eagle3's shape (below DFlash at position 1, not falling to position 3): {'; '.join(parts)}. "
                 f"{verdict(holds).capitalize()}.")


def judge_claims(records: dict, K: int, *, n_boot: int = 1000, seed: int = 0) -> tuple[list[Claim], str]:
    """The claims of the module docstring on `records` ({method: {domain:
    [per-benchmark records]}}, the same benchmarks for every method), and the
    estimator used ("rb" or "count")."""
    r = _Rates(records, K, n_boot, seed)
    claims = []
    if {"dflash"} <= set(r.methods):
        claims.append(_suffix_decay(r))
    if {"dspark", "dflash"} <= set(r.methods):
        claims.append(_stability(r))
    claims += [c for c in (_macro_tau(r, "dflash"), _macro_tau(r, "eagle3")) if c is not None]
    if {"dspark", "dflash"} & set(r.methods):
        claims.append(_position_one(r))
    if {"eagle3", "dflash"} <= set(r.methods):
        claims.append(_eagle3_shape(r))
    return claims, r.kind


def figure_line(claims: list[Claim]) -> str:
    """One line for Figure 2: which claims hold."""
    return "; ".join(f"{c.name}: {verdict(c.holds)}" for c in claims)

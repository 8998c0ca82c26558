"""The rules of workflow/rules/throughput.smk: `throughput` (the batched engine
under load, results/tables/throughput.csv) and `fig7` (figures/fig7.pdf).
Paper Sec. 3.2.2 and Figures 7-8.

For every concurrency level (throughput.concurrency: the engine's rows) and
policy (throughput.policies), the same throughput.requests requests (prompts
round-robin over the preset's benchmarks, seeds eval.seed + i) are decoded by
the engine with continuous batching:

* plain   - plain batched decoding (no drafter);
* fixed   - every drafted token (gamma);
* threshold=t - the static confidence threshold t, for each t in throughput.thresholds;
* alg1    - live Algorithm 1 with the engine's SPS(B) profiled at start-up for
            this concurrency (`core.engine.profile_engine_sps`) or read from
            throughput.sps_csv, and STS temperatures when --sts names a
            schedule rule's alg1.json;
* alg1-padded - the same with one common width per round (PaddedAlgorithm1,
            our addition: what a padded forward really costs).

One row per (concurrency, policy): target, method, policy, concurrency,
requests, new_tokens, wall_s, tokens_per_s (all requests), per_request_tokens_per_s
(mean over requests of new tokens / time from joining to leaving),
mean_verify_len (mean l_r over rounds), tau (mean emitted per round).
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from ..config import add_config_args, config_from_args
from ..data.prompts import benchmark_prompt_ids
from ..errors import DeepSpecError
from ..files import pyplot, read_json, save_figure, write_csv_atomic
from ..paths import RunPaths
from ..settings import Settings, Throughput

log = logging.getLogger(__name__)

COLUMNS = ["target", "method", "policy", "concurrency", "requests", "new_tokens", "wall_s", "tokens_per_s",
           "per_request_tokens_per_s", "mean_verify_len", "tau"]


def load_prompts(cfg, target, n: int) -> list:
    """n prompt token lists, round-robin over the benchmarks (repeating when fewer).
    `cfg`: a config or Settings."""
    s = Settings.view(cfg)
    per = [[ids for _, ids in benchmark_prompt_ids(s, target, b)] for b in s.data.benchmarks]
    pool = [p[i] for i in range(max(map(len, per))) for p in per if i < len(p)]
    if not pool:
        raise DeepSpecError("throughput: the preset's benchmarks have no prompts")
    return [pool[i % len(pool)] for i in range(n)]


def make_policy(name: str, *, sps=None, temperatures=None):
    from ..core.policies import FixedGamma, LiveAlgorithm1, PaddedAlgorithm1, StaticThreshold

    if name in ("plain", "fixed"):
        return FixedGamma()
    if name.startswith("threshold="):
        return StaticThreshold(float(name.split("=", 1)[1]))
    if name == "alg1":
        return LiveAlgorithm1(sps, temperatures=temperatures)
    if name == "alg1-padded":
        return PaddedAlgorithm1(sps, temperatures=temperatures)
    if name.startswith("fixed="):
        return FixedGamma(int(name.split("=", 1)[1]))
    raise DeepSpecError(f"unknown throughput policy {name!r}")


def run_load(target, drafter, prompts, *, policy, concurrency: int, max_new_tokens: int, temperature: float,
             seed: int, feature_layers) -> dict:
    """One engine run of all requests at this concurrency; the measured row (without target/method)."""
    from ..core.engine import BatchedEngine, Request

    engine = BatchedEngine(target, drafter, feature_layers=feature_layers, temperature=temperature, policy=policy,
                           max_batch=concurrency)
    reqs = [Request(i, ids, max_new_tokens, seed=seed + i) for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t0
    rounds = [r for f in done for r in f.rounds]
    new = sum(len(f.tokens) for f in done)
    return {"concurrency": concurrency, "requests": len(reqs), "new_tokens": new, "wall_s": wall,
            "tokens_per_s": new / wall, "per_request_tokens_per_s": float(np.mean([len(f.tokens) / f.time_s for f in done])),
            "mean_verify_len": float(np.mean([r["verify_tokens"] - 1 for r in rounds])) if rounds else 0.0,
            "tau": float(np.mean([r["emitted"] for r in rounds])) if rounds else 1.0}


def engine_sps(tp: Throughput, target, concurrency: int, gamma: int):
    """SPS(B) for Algorithm 1: throughput.sps_csv, or profiled on this engine and machine."""
    from ..core.engine import profile_engine_sps
    from ..core.scheduler import SPSCurve

    if tp.sps_csv:
        return SPSCurve.from_csv(tp.sps_csv)
    return profile_engine_sps(target, concurrency, list(range(1, gamma + 2)), context_len=tp.sps_context)


def policy_names(tp: Throughput) -> list[str]:
    out = []
    for p in tp.policies:
        out += [f"threshold={t:g}" for t in tp.thresholds] if p == "threshold" else [p]
    return out


def measure(s: Settings, target, drafter, method: str, names, temperatures=None) -> pd.DataFrame:
    """Every (concurrency, policy) row of throughput.csv."""
    tp, ev = s.throughput, s.eval
    from .evaluate import feature_layers

    layers = feature_layers(s, drafter)
    rows = []
    for c in tp.concurrency:
        prompts = load_prompts(s, target, max(tp.requests, c))
        sps = engine_sps(tp, target, c, drafter.gamma) if any(n.startswith("alg1") for n in names) else None
        if sps is not None:  # the curve Algorithm 1 decides by: what explains its choices
            log.info("SPS(B) at concurrency %d: %s", c, ", ".join(f"B={int(b)}: {v:.1f}/s" for b, v in
                                                               zip(sps.batch_tokens, sps.steps_per_s)))
        for name in names:
            pol = make_policy(name, sps=sps, temperatures=temperatures)
            row = run_load(target, None if name == "plain" else drafter, prompts, policy=pol, concurrency=c,
                           max_new_tokens=tp.max_new_tokens, temperature=ev.temperature, seed=ev.seed,
                           feature_layers=layers)
            rows.append({"target": s.target.name, "method": method, "policy": name, **row})
            log.info("%s at concurrency %d: %.2f tokens/s, %.2f per request, verify %.2f, tau %.2f", name, c,
                     row["tokens_per_s"], row["per_request_tokens_per_s"], row["mean_verify_len"], row["tau"])
    return pd.DataFrame(rows, columns=COLUMNS)


def cli_throughput(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec throughput", description="the batched engine under load (Figures 7-8)")
    add_config_args(p)
    p.add_argument("--method", help="drafter (default throughput.method)")
    p.add_argument("--drafter", help="drafter directory (default R/T/drafters/<method>)")
    p.add_argument("--sts", help="a schedule rule's alg1.json: Algorithm 1 uses its STS temperatures")
    p.add_argument("--out", help="CSV (default R/tables/throughput.csv)")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    from .evaluate import drafter_path, eval_drafter, eval_target

    method = args.method or s.throughput.method
    out = Path(args.out) if args.out else RunPaths.of(s).table("throughput.csv")
    target = eval_target(s)  # evaluate's dtype (eval.precision)
    drafter = eval_drafter(drafter_path(s, method, args.drafter), target, s)
    temps = read_json(Path(args.sts))["sts_temperatures"] if args.sts else None
    names = policy_names(s.throughput)
    if any(n.startswith("alg1") for n in names) and drafter.config.deepspec_confidence_head is False:
        raise DeepSpecError(f"throughput: Algorithm 1 needs a drafter with a confidence head ({method} has none)")
    write_csv_atomic(measure(s, target, drafter, method, names, temps), out)
    return 0


def best_threshold(df: pd.DataFrame) -> pd.DataFrame:
    """plain, fixed, alg1 and, per concurrency, the static threshold with the highest throughput."""
    thr = df[df["policy"].str.startswith("threshold=")]
    best = thr.loc[thr.groupby("concurrency")["tokens_per_s"].idxmax()].assign(policy="threshold (best)")
    return pd.concat([df[~df["policy"].str.startswith("threshold=")], best], ignore_index=True)


def plot_fig7(df: pd.DataFrame, pdf: Path, png: Path | None = None, title: str = "") -> None:
    """Left (Figure 7): total throughput against per-request speed, one curve per
    policy over the concurrency levels. Right (Figure 8): mean verification
    budget l_r per request against concurrency."""
    plt = pyplot()

    d = best_threshold(df)
    colors = {"plain": "C0", "fixed": "C1", "threshold (best)": "C3", "alg1": "C2", "alg1-padded": "C4"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for pol, g in d.groupby("policy", sort=False):
        g = g.sort_values("concurrency")
        kw = dict(marker="o", label=pol, color=colors.get(pol))
        a.plot(g["per_request_tokens_per_s"], g["tokens_per_s"], **kw)
        for _, r in g.iterrows():
            a.annotate(str(int(r["concurrency"])), (r["per_request_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
        if pol != "plain":
            b.plot(g["concurrency"], g["mean_verify_len"], **kw)
    a.set(xlabel="per-request tokens/s (labels: concurrency)", ylabel="total tokens/s",
          title="throughput vs per-request speed")
    levels = sorted(d["concurrency"].unique())
    b.set_xscale("log", base=2)
    b.set_xticks(levels, [str(int(c)) for c in levels])
    b.set(xlabel="concurrency (requests in the batch)", ylabel="mean verified draft tokens per request",
          title="verification budget vs load")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, pdf, png)
    plt.close(fig)


def cli_fig7(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec fig7", description="Figures 7-8 from throughput.csv")
    add_config_args(p)
    p.add_argument("--csv", required=True)
    p.add_argument("--pdf", required=True)
    p.add_argument("--png")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    df = pd.read_csv(args.csv)
    if df.empty:
        raise DeepSpecError(f"{args.csv}: no rows")
    plot_fig7(df, Path(args.pdf), Path(args.png) if args.png else None,
              title=f"{s.target.name}: batched engine under load")
    return 0

"""The learning curve that sizes the CPU presets: each drafter's held-out
acceptance against regenerated training tokens and optimiser steps, with the
CPU-seconds each point cost.

    python benchmarks/drafter_scaling.py [--preset smollm2-135m] [--tokens 30000 100000 300000]
        [--steps 300 900 2700] [--eagle3-steps 100 300] [--methods dflash dspark eagle3]
        [--arm NAME KEY=VALUE ...] [--arm NAME2 KEY=VALUE ...] [--jobs 2] [--out results/scaling]

1. Data, through the DAG itself (`snakemake ... cache/manifest.json`, so the
   cost is the presets' cost): a training pool of the preset's sources with
   their caps scaled up until the pool holds the largest token budget, and a
   held-out set of benchmark prompts per domain that the preset does NOT
   evaluate (its eval subsample is excluded), both answered by the target
   (regenerate) and cached (build_cache). CPU-seconds are those of every
   process snakemake ran.
2. Training: for each (budget, steps, method) a drafter trained by the
   pipeline's own loop (`deepspec.training.loop.train`, the preset's recipe
   with train.max_steps = steps) on a nested subset of the pool: samples in
   one fixed shuffled order, as many as hold `budget` answer tokens, so a
   larger budget only adds samples. One process per point, one thread each,
   `--jobs` at a time.
3. Acceptance: on the held-out set, the per-position acceptance rate of the
   drafter's proposals against the target, c*_k = sum_v min(p_d, p_t)
   (paper Eq. 8) at T = 1 with the previous block tokens teacher-forced to the
   target's own answer; every answer position is an anchor. This is the
   quantity Figure 2's Rao-Blackwellised estimator averages, measured without
   the decoding loop (the decoded prefix is the target's sample instead of an
   accepted draft), so it is cheap enough for a grid. Intervals: 95 %
   bootstrap over held-out samples.

4. Paired A/B (`--arm base --arm anchors64 train.num_anchors=64 ...`): every
   point once per arm, an arm being a name and preset overrides (`--set`
   syntax; `--layer-archs target qwen3` is short for two arms setting
   drafter.layer_arch), with the same seed, data subset and steps, so the arms
   differ only in their overrides; paired.csv / paired.md give each arm's
   acceptance minus the first arm's per domain and position, and the macro
   E[tau] difference, with 95 % paired-bootstrap intervals over the held-out
   samples (both arms measured on the same samples). An arm's `steps=` scales
   the point's steps (e.g. steps=0.5 for an arm whose steps cost twice as much:
   equal CPU time). The grid's own axes are contrasted the same way, every
   point being measured on the same held-out samples: paired-tokens.* gives
   each token budget minus each smaller one at equal steps, paired-steps.*
   each step count minus each smaller one at an equal budget.

Outputs under --out: scaling.csv (method, arm, tokens, steps, domain,
position, acceptance, ci_low, ci_high, n_samples, train_cpu_s, data_cpu_s),
scaling.md (the table the docs quote: position-1..3 acceptance per domain,
expected tau and CPU-seconds per point), scaling.png and, along each axis with
two or more values, paired.* (arms), paired-tokens.* and paired-steps.*. A finished point is kept in
points/<name>.json, so a rerun only computes what is missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import json
import math
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DOMAINS = ("Math", "Code", "Chat")
GAMMA_SHOWN = 3  # positions in the markdown table (the CSV has all of them)


# ------------------------------------------------------------------ data


def heldout_prompts(cfg: dict, per_domain: int, seed: int, max_chars: int = 1500) -> dict[str, list[dict]]:
    """Per domain, `per_domain` benchmark prompts that the preset does not
    evaluate (its subsample of each benchmark is excluded), first turns of at
    most `max_chars` characters (so that prompt and answer fit the preset's
    data.max_length, and a regeneration batch's KV cache stays small), drawn
    in turn from the domain's benchmarks in a seeded order."""
    from deepspec.data.prompts import data_root, read_turns_jsonl, subsample

    root, out = data_root(cfg), {}
    for domain in DOMAINS:
        pools = []
        for name, b in cfg["data"]["benchmarks"].items():
            if b["domain"] != domain:
                continue
            rows = read_turns_jsonl(root / b["path"])
            used = {p.id for p in subsample(rows, b.get("cap"), cfg["data"]["seed"])}
            rest = [p for p in rows if p.id not in used and len(p.turns[0]) <= max_chars]
            random.Random(f"{seed}:{name}").shuffle(rest)
            pools.append(rest)
        picked = []
        while len(picked) < per_domain and any(pools):
            for pool in pools:
                if pool and len(picked) < per_domain:
                    picked.append({"turns": pool.pop().turns[:1]})
        out[domain] = picked
    return out


def pool_sources(cfg: dict, max_tokens: int, tokens_per_prompt: float) -> list[dict]:
    """The preset's training sources with their caps scaled (same proportions)
    so that the pool holds about `max_tokens` answer tokens, with a 15 % margin."""
    train = cfg["data"]["train"]
    caps = [e.get("cap") or 100 for e in train]
    scale = 1.15 * max_tokens / tokens_per_prompt / sum(caps)
    return [dict(e, cap=max(1, math.ceil(c * scale))) for e, c in zip(train, caps)]


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def build_data(preset: str, results: Path, data: dict, cores: int, log: Path) -> dict:
    """Regenerate and cache `data` through the DAG; returns the cache manifest,
    the wall and CPU seconds of the run (0 when it was already there)."""
    from deepspec.config import load_config
    from deepspec.paths import RunPaths

    cfg = load_config(preset, {"results_dir": str(results), "data": data})
    manifest = RunPaths.of(cfg).cache_dir() / "manifest.json"
    cost_file = results / "data_cost.json"
    if manifest.exists() and cost_file.exists():
        return {**json.loads(cost_file.read_text()), "manifest": json.loads(manifest.read_text())}
    cmd = [sys.executable, "-m", "snakemake", "--cores", str(cores), str(manifest), "--config",
           f"preset={preset}", f"results_dir={results}", f"logs_dir={results / 'logs'}", "data=" + json.dumps(data)]
    t0, c0 = time.perf_counter(), _cpu_children()
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"drafter_scaling: the data run failed (see {log}): {' '.join(cmd)}")
    cost = {"wall_s": time.perf_counter() - t0, "cpu_s": _cpu_children() - c0}
    cost_file.write_text(json.dumps(cost))
    return {**cost, "manifest": json.loads(manifest.read_text())}


def loss_tokens(dataset) -> np.ndarray:
    """Answer (loss-mask) tokens of every sample of a CacheDataset."""
    out = np.zeros(len(dataset), dtype=np.int64)
    for i, (k, a, b) in enumerate(dataset._index):
        out[i] = int(dataset._open(k).get_slice("loss_mask")[a:b].sum())
    return out


def nested_subsets(tokens: np.ndarray, budgets: list[int], seed: int) -> dict[int, list[int]]:
    """For each budget, the shortest prefix of one seeded permutation of the
    samples that holds >= budget answer tokens (all samples if none does), so
    that the subsets are nested."""
    order = np.random.default_rng(seed).permutation(len(tokens))
    cum = np.cumsum(tokens[order])
    out = {}
    for b in budgets:
        n = int(np.searchsorted(cum, b) + 1) if cum.size and cum[-1] >= b else len(order)
        out[b] = sorted(order[:n].tolist())
    return out


# ------------------------------------------------------------------ one point


def heldout_acceptance(drafter, dataset, spec) -> list[tuple[str, list[float]]]:
    """(domain, [c*_1 .. c*_gamma]) per held-out sample, every answer position an anchor."""
    import torch

    from deepspec.data.datasets import collate

    spec = dataclasses.replace(spec, num_anchors=1 << 16)
    out = []
    drafter.eval()
    with torch.no_grad():
        for i in range(len(dataset)):
            _, m = drafter.training_step(collate([dataset[i]]), spec, torch.Generator().manual_seed(i), log_step=True)
            cs = [m[k] for k in sorted((k for k in m if k.startswith("c_star_")), key=lambda k: int(k.rsplit("_", 1)[1]))]
            out.append((dataset.ids[i].split(":", 1)[0], cs))
    return out


def run_point(job: dict) -> dict:
    """Train one drafter on one subset and measure it on the held-out set (a
    worker process, one thread)."""
    import torch

    torch.set_num_threads(1)
    from deepspec import drafters
    from deepspec.config import load_config
    from deepspec.data.datasets import CacheDataset, collate, token_counts
    from deepspec.methods import resolve_method
    from deepspec.targets.loading import target_from_config
    from deepspec.training.loop import train
    from deepspec.training.run import step_spec

    t0 = time.process_time()
    base, cfg = resolve_method(load_config(job["preset"], job["overrides"]), job["method"])
    target = target_from_config(cfg, device="cpu")
    pool = torch.utils.data.Subset(CacheDataset(job["pool_cache"]), job["indices"])
    counts = token_counts(pool, target.vocab_size) if cfg["drafter"].get("draft_vocab_size") else None
    torch.manual_seed(int(cfg["train"]["seed"]))
    drafter = drafters.build_drafter(base, target, cfg, token_counts=counts)
    spec = step_spec(cfg)

    def step_fn(model, batch, generator, log_step=True):
        return model.training_step(batch, spec, generator, log_step=log_step)

    train(drafter, pool, step_fn, cfg["train"], job["out"], collate_fn=collate, resume=False)
    t1 = time.process_time()
    rows = heldout_acceptance(drafter, CacheDataset(job["heldout_cache"]), spec)
    return {**{k: job[k] for k in ("method", "tokens", "steps")}, "arm": job.get("arm"), "arm_steps": job["arm_steps"],
            "actual_tokens": job["actual_tokens"],
            "train_cpu_s": t1 - t0, "eval_cpu_s": time.process_time() - t1, "samples": rows}


# ------------------------------------------------------------------ summary


def summarize(points: list[dict], data_cpu_per_token: float, n_boot: int = 1000, seed: int = 0):
    """Rows of scaling.csv: mean acceptance per (point, domain, position) with a
    95 % bootstrap interval over held-out samples."""
    import pandas as pd

    rows = []
    rng = np.random.default_rng(seed)
    for p in points:
        for domain in DOMAINS:
            x = np.array([cs for d, cs in p["samples"] if d == domain])
            if x.size == 0:
                continue
            boot = x[rng.integers(0, len(x), (n_boot, len(x)))].mean(1)  # [n_boot, gamma]
            for k in range(x.shape[1]):
                rows.append({"method": p["method"], "arm": p.get("arm") or "preset", "arm_steps": p.get("arm_steps", p["steps"]),
                             "tokens": p["tokens"], "actual_tokens": p["actual_tokens"],
                             "steps": p["steps"], "domain": domain, "position": k + 1,
                             "acceptance": x[:, k].mean(), "ci_low": np.quantile(boot[:, k], 0.025),
                             "ci_high": np.quantile(boot[:, k], 0.975), "n_samples": len(x),
                             "expected_tau": 1 + np.cumprod(x.mean(0)).sum(),
                             "train_cpu_s": p["train_cpu_s"], "data_cpu_s": data_cpu_per_token * p["actual_tokens"]})
    return pd.DataFrame(rows)


def markdown(df) -> str:
    archs = df.arm.nunique() > 1 if "arm" in df else False
    lines = ["| method | " + ("arm | " if archs else "") + "tokens | steps | "
             + " | ".join(f"{d} c*1..{GAMMA_SHOWN}" for d in DOMAINS)
             + " | macro E[tau] | train CPU-s | data CPU-s |", "|---" * (6 + archs + len(DOMAINS)) + "|"]
    keys = ["method", "arm", "tokens", "steps"] if archs else ["method", "tokens", "steps"]
    for key, g in df.groupby(keys, sort=False):
        m, s = key[0], g.arm_steps.iloc[0] if "arm_steps" in g else key[-1]
        cells = []
        for d in DOMAINS:
            v = g[(g.domain == d) & (g.position <= GAMMA_SHOWN)].sort_values("position").acceptance
            cells.append(" / ".join(f"{a:.2f}" for a in v) if len(v) else "-")
        tau = g.groupby("domain").expected_tau.first().mean()
        n = g.actual_tokens.iloc[0]
        lines.append(f"| {m} | " + (f"{key[1]} | " if archs else "") + f"{f'{n / 1000:.0f}k' if n >= 1000 else n} | {s} | "
                     + " | ".join(cells)
                     + f" | {tau:.2f} | {g.train_cpu_s.iloc[0]:.0f} | {g.data_cpu_s.iloc[0]:.0f} |")
    return "\n".join(lines) + "\n"


# what a contrast holds fixed, per axis it runs along
HELD = {"arm": ("method", "tokens", "steps"), "tokens": ("method", "arm", "steps"), "steps": ("method", "arm", "tokens")}


def paired(points: list[dict], along: str = "arm", n_boot: int = 2000, seed: int = 0):
    """Contrasts along one axis of the grid, the others held fixed: each arm minus
    the first arm (`along="arm"`), or each token budget (step count) minus each
    smaller one (`"tokens"`, `"steps"`). Rows of paired*.csv: per domain and position
    the acceptance difference and, per domain and macro (position "tau"), the
    E[tau] difference, each with a 95 % paired-bootstrap interval (the same
    resampled held-out samples for both points)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault(tuple(p.get(k) for k in HELD[along]), []).append(p)
    rows = []
    for ps in groups.values():
        if along == "arm":
            pairs = [(ps[0], other) for other in ps[1:]]
        else:
            ps = sorted(ps, key=lambda p: p[along])
            pairs = [(base, other) for i, base in enumerate(ps) for other in ps[i + 1:]]
        for base, other in pairs:
            if [d for d, _ in other["samples"]] != [d for d, _ in base["samples"]]:
                raise SystemExit(f"paired: {base['method']} points were measured on different held-out samples")
            ident = {"method": other["method"], "tokens": other["tokens"], "steps": other["steps"],
                     "arm": other.get("arm"), "along": along, "baseline": base.get(along)}
            taus_a, taus_b = [], []
            for domain in DOMAINS:
                idx = [i for i, (d, _) in enumerate(base["samples"]) if d == domain]
                if not idx:
                    continue
                a = np.array([base["samples"][i][1] for i in idx])  # [n, gamma]
                b = np.array([other["samples"][i][1] for i in idx])
                draw = rng.integers(0, len(idx), (n_boot, len(idx)))
                ma, mb = a[draw].mean(1), b[draw].mean(1)  # [n_boot, gamma]
                ta, tb = 1 + np.cumprod(ma, 1).sum(1), 1 + np.cumprod(mb, 1).sum(1)
                taus_a.append((1 + np.cumprod(a.mean(0)).sum(), ta))
                taus_b.append((1 + np.cumprod(b.mean(0)).sum(), tb))
                head = {**ident, "domain": domain, "n_samples": len(idx)}
                for k in range(a.shape[1]):
                    diff = mb[:, k] - ma[:, k]
                    rows.append({**head, "position": k + 1, "baseline_value": a[:, k].mean(),
                                 "arm_value": b[:, k].mean(), "diff": b[:, k].mean() - a[:, k].mean(),
                                 "ci_low": np.quantile(diff, 0.025), "ci_high": np.quantile(diff, 0.975)})
                rows.append({**head, "position": "tau", "baseline_value": taus_a[-1][0], "arm_value": taus_b[-1][0],
                             "diff": taus_b[-1][0] - taus_a[-1][0], "ci_low": np.quantile(tb - ta, 0.025),
                             "ci_high": np.quantile(tb - ta, 0.975)})
            ma_tau = np.mean([t for t, _ in taus_a])
            mb_tau = np.mean([t for t, _ in taus_b])
            dboot = np.mean([tb for _, tb in taus_b], 0) - np.mean([ta for _, ta in taus_a], 0)
            rows.append({**ident, "domain": "macro", "n_samples": len(base["samples"]),
                         "position": "tau", "baseline_value": ma_tau, "arm_value": mb_tau, "diff": mb_tau - ma_tau,
                         "ci_low": np.quantile(dboot, 0.025), "ci_high": np.quantile(dboot, 0.975)})
    return pd.DataFrame(rows)


def _k(n: int) -> str:
    return f"{n / 1000:.0f}k" if n >= 1000 else str(n)


def paired_markdown(df) -> str:
    """paired*.csv as the table the docs quote: what the contrast holds fixed, the
    contrast, positions 1..GAMMA_SHOWN per domain and macro E[tau]."""
    lines = ["| method | at | contrast | " + " | ".join(f"{d} Δc*1..{GAMMA_SHOWN}" for d in DOMAINS)
             + " | Δ macro E[tau] |", "|---" * (4 + len(DOMAINS)) + "|"]

    def cell(r):
        return f"{r['diff']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"

    for _, g in df.groupby(["method", "tokens", "steps", "arm", "along", "baseline"], sort=False, dropna=False):
        r0 = g.iloc[0]
        arm = "" if r0.arm is None or r0.arm != r0.arm else f" ({r0.arm})"
        if r0.along == "arm":
            at, contrast = f"{r0.steps}", f"{r0.arm} − {r0.baseline}"
        elif r0.along == "tokens":
            at, contrast = f"{r0.steps} steps{arm}", f"{_k(r0.tokens)} − {_k(r0.baseline)} tokens"
        else:
            at, contrast = f"{_k(r0.tokens)} tokens{arm}", f"{r0.steps} − {r0.baseline} steps"
        cells = []
        for d in DOMAINS:
            pos = g[(g.domain == d) & (g.position.astype(str).isin([str(k) for k in range(1, GAMMA_SHOWN + 1)]))]
            cells.append("<br>".join(cell(r) for _, r in pos.iterrows()) or "-")
        macro = g[(g.domain == "macro")].iloc[0]
        lines.append(f"| {r0.method} | {at} | {contrast} | " + " | ".join(cells) + f" | {cell(macro)} |")
    return "\n".join(lines) + "\n"


def plot(df, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(DOMAINS), figsize=(4 * len(DOMAINS), 3.2), sharey=True)
    p1 = df[df.position == 1]
    for ax, d in zip(axes, DOMAINS):
        for (m, a, s), g in p1[p1.domain == d].groupby(["method", "arm", "arm_steps"]):
            g = g.sort_values("actual_tokens")
            ax.errorbar(g.actual_tokens, g.acceptance, yerr=[g.acceptance - g.ci_low, g.ci_high - g.acceptance],
                        marker="o", capsize=2, label=f"{m}{'' if a == 'preset' else f' ({a})'}, {s} steps")
        ax.set_xscale("log")
        ticks = sorted(set(p1.actual_tokens))
        ax.set_xticks(ticks, [_k(int(t)) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(d)
        ax.set_xlabel("regenerated training tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out acceptance, position 1")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ main


def parse_arms(arm_args, layer_archs) -> dict:
    """{arm name (None: the preset as it is): (preset overrides, step scale)}
    from --arm NAME KEY=VALUE ... (and --layer-archs, short for drafter.layer_arch arms)."""
    from deepspec.config import parse_set

    arms = {}
    for a in (arm_args or []) + [[x, f"drafter.layer_arch={x}"] for x in layer_archs or []]:
        name, sets = a[0], a[1:]
        if "=" in name or name in arms:
            raise SystemExit(f"--arm {name}: an arm starts with a new name, then KEY=VALUE overrides")
        scale = [float(x.split("=", 1)[1]) for x in sets if x.startswith("steps=")]
        arms[name] = (parse_set([x for x in sets if not x.startswith("steps=")]), scale[-1] if scale else 1.0)
    return arms or {None: ({}, 1.0)}


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--tokens", type=int, nargs="+", default=[30000, 100000, 300000])
    p.add_argument("--steps", type=int, nargs="+", default=[300, 900, 2700])
    p.add_argument("--eagle3-steps", type=int, nargs="+", default=None,
                   help="Eagle3's step grid instead of --steps (its 7-step TTT chain costs ~6x a DFlash step)")
    p.add_argument("--methods", nargs="+", default=["dflash", "dspark", "eagle3"])
    p.add_argument("--arm", nargs="+", action="append", default=None, metavar="NAME [KEY=VALUE ...]",
                   help="an arm: a name and preset overrides (KEY=VALUE as --set; steps=F scales the point's steps); "
                        "each point once per arm, same seed, data and steps; paired.md gives each arm minus the first")
    p.add_argument("--layer-archs", nargs="+", default=None, choices=["target", "qwen3"],
                   help="short for --arm target drafter.layer_arch=target --arm qwen3 drafter.layer_arch=qwen3")
    p.add_argument("--heldout-per-domain", type=int, default=48)
    p.add_argument("--tokens-per-prompt", type=float, default=100.0,
                   help="answer tokens per training prompt, to size the pool (the default preset: ~100)")
    p.add_argument("--jobs", type=int, default=2, help="training processes at a time (one thread each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "results" / "scaling")
    args = p.parse_args(argv)
    arms = parse_arms(args.arm, args.layer_archs)

    from deepspec.config import load_config
    from deepspec.data.datasets import CacheDataset
    from deepspec.files import write_text_atomic
    from deepspec.paths import RunPaths

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.preset)
    held = heldout_prompts(cfg, args.heldout_per_domain, args.seed)
    for d, rows in held.items():
        write_text_atomic(out / "data" / f"{d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    held_data = {"train": [{"path": str(out / "data" / f"{d}.jsonl")} for d in DOMAINS]}
    pool_data = {"train": pool_sources(cfg, max(args.tokens), args.tokens_per_prompt)}
    print(f"pool sources: {pool_data['train']}", flush=True)
    pool = build_data(args.preset, out / "pool", pool_data, args.jobs, out / "pool.log")
    heldout = build_data(args.preset, out / "heldout", held_data, args.jobs, out / "heldout.log")
    pool_cache = RunPaths.of(load_config(args.preset, {"results_dir": str(out / "pool")})).cache_dir()
    held_cache = RunPaths.of(load_config(args.preset, {"results_dir": str(out / "heldout")})).cache_dir()
    n_loss = pool["manifest"]["num_loss_tokens"]
    data_cpu_per_token = pool["cpu_s"] / n_loss if pool["cpu_s"] else float("nan")
    print(f"pool: {n_loss} answer tokens, {pool['cpu_s']:.0f} CPU-s ({pool['wall_s']:.0f} s wall); "
          f"held-out: {heldout['manifest']['num_samples']} samples", flush=True)

    tokens = loss_tokens(CacheDataset(pool_cache))
    subsets = nested_subsets(tokens, args.tokens, args.seed)
    for b in args.tokens:
        if tokens.sum() < b:
            print(f"warning: the pool holds {tokens.sum()} answer tokens, under the budget {b}: "
                  "that point uses all of it (raise --tokens-per-prompt's estimate down)", flush=True)
    jobs = []
    for b in args.tokens:
        for m in args.methods:
            for s in (args.eagle3_steps or args.steps) if m == "eagle3" else args.steps:
                for arm, (arm_over, scale) in arms.items():
                    name = f"{m}-{b}-{s}" + (f"-{arm}" if arm else "")
                    steps = max(1, round(s * scale))
                    over = deep_merge({"results_dir": str(out / "pool"), "train": {"epochs": 10000}}, arm_over)
                    over["train"]["max_steps"] = steps
                    jobs.append({"preset": args.preset, "method": m, "tokens": b, "steps": s, "arm_steps": steps,
                                 "name": name, "arm": arm, "overrides": over,
                                 "pool_cache": str(pool_cache), "heldout_cache": str(held_cache),
                                 "indices": subsets[b], "actual_tokens": int(tokens[subsets[b]].sum()),
                                 "out": str(out / "runs" / name)})
    (out / "points").mkdir(exist_ok=True)
    todo = [j for j in jobs if not (out / "points" / f"{j['name']}.json").exists()]
    # the longest first, so that the last job to finish is a short one
    todo.sort(key=lambda j: -j["arm_steps"] * {"eagle3": 3.5, "dspark": 1.0, "dflash": 0.6}.get(j["method"], 1.0))
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as ex:
        running = {ex.submit(run_point, j): j for j in todo}
        for f in futures.as_completed(running):
            j, r = running[f], f.result()
            write_text_atomic(out / "points" / f"{j['name']}.json", json.dumps(r))
            c1 = np.mean([cs[0] for _, cs in r["samples"]])
            print(f"{j['name']}: held-out c*_1 {c1:.3f}, train {r['train_cpu_s']:.0f} CPU-s", flush=True)
    points = [json.loads((out / "points" / f"{j['name']}.json").read_text()) for j in jobs]
    df = summarize(points, data_cpu_per_token)
    df.to_csv(out / "scaling.csv", index=False)
    table = markdown(df)
    write_text_atomic(out / "scaling.md", table)
    plot(df, out / "scaling.png")
    print(table)
    # contrasts along each axis with two or more values: arms (paired.*), budgets, step counts
    for along, n, name in (("arm", len(arms), "paired"), ("tokens", len(args.tokens), "paired-tokens"),
                           ("steps", len(set(args.steps) | set(args.eagle3_steps or [])), "paired-steps")):
        pairs = paired(points, along) if n > 1 else []
        if len(pairs):
            pairs.to_csv(out / f"{name}.csv", index=False)
            write_text_atomic(out / f"{name}.md", paired_markdown(pairs))
            print(paired_markdown(pairs))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

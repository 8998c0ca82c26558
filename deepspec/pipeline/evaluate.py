"""The rules of workflow/rules/evaluate.smk: `evaluate` (speculative decoding with a drafter), `baseline`
(plain and prompt-lookup decoding) and `schedule` (threshold sweep, STS
calibration and Algorithm 1 on DSpark records). Paper Sec. 4; notes §1.5, §1.6, §3.

Outputs under R/T/eval/ (R = results_dir, T = target name), all written atomically:
  <method>/<benchmark>.csv   one row per round (docs/INTERFACES.md) + method, benchmark, domain
  <method>/<benchmark>.json  summary: tau with CI, per-position table, tokens/s, speedup vs plain
  baseline/<benchmark>.json  tokens/s of plain and prompt-lookup decoding (+ per-sample .csv)
  dspark/<benchmark>.{sweep.csv, calibration.csv, alg1.json}
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..cli import add_config_args, config_from_args
from ..errors import DeepSpecError
from ..files import json_safe, read_json, require_file, write_csv_atomic, write_json_atomic
from ..paths import RunPaths
from .prompts import benchmark_prompt_ids

log = logging.getLogger(__name__)


def _generator(cfg: dict, target, idx: int) -> torch.Generator:
    """The per-sample seed of the reference evaluator: eval.seed + sample index."""
    return torch.Generator(device=target.device).manual_seed(cfg["eval"]["seed"] + idx)


def drafter_path(cfg: dict, method: str, override: str | None = None) -> str:
    if override:
        return override
    released = cfg["eval"]["released_checkpoints"].get(method)
    if released:
        return released
    return str(RunPaths.of(cfg).drafter_dir(method))


def _tokens_per_s(samples: list[dict]) -> float:
    t = sum(s["time_s"] for s in samples)
    return sum(s["new_tokens"] for s in samples) / t if t > 0 else float("nan")


# --------------------------------------------------------------------------- evaluate
def _warmup(fn) -> None:
    """One short untimed run (kernel selection, allocator, lazy init) before timing."""
    fn()


def run_evaluation(cfg: dict, target, drafter, prompts, *, method: str, benchmark: str, domain: str):
    """Speculative decoding over `prompts`; returns (per-round DataFrame, per-sample list)."""
    from tqdm import tqdm

    from ..core.decode import speculative_generate

    ev = cfg["eval"]
    layers = list(getattr(drafter.config, "deepspec_feature_layers", None) or cfg["target"]["feature_layers"])
    rows, samples = [], []
    _warmup(lambda: speculative_generate(target, drafter, prompts[0][1], feature_layers=layers, max_new_tokens=4,
                                         temperature=ev["temperature"], generator=_generator(cfg, target, 0)))
    for idx, (p, ids) in enumerate(tqdm(prompts, desc=f"{method}/{benchmark}", unit="prompt")):
        gen = speculative_generate(
            target, drafter, ids, feature_layers=layers, max_new_tokens=ev["max_new_tokens"],
            temperature=ev["temperature"], generator=_generator(cfg, target, idx),
            confidence_threshold=ev["confidence_threshold"],
        )
        rows += [{"sample_id": p.id, **r, "method": method, "benchmark": benchmark, "domain": domain} for r in gen.rounds]
        samples.append({"sample_id": p.id, "prompt_tokens": len(ids), "new_tokens": len(gen.tokens),
                        "rounds": len(gen.rounds), "time_s": gen.time_s})
        log.info("%s: %d tokens in %d rounds, %.2f s", p.id, len(gen.tokens), len(gen.rounds), gen.time_s)
    if not rows:
        raise DeepSpecError(f"{method}/{benchmark}: no speculative rounds (every sample ended on its first token)")
    return pd.DataFrame(rows), samples


def summarize(cfg: dict, df: pd.DataFrame, samples: list[dict], *, gamma: int, baseline_json: Path) -> dict:
    from ..core.acceptance import confidence_selfcheck, position_table, summarize_rounds

    n_boot, seed = cfg["eval"]["n_boot"], cfg["eval"]["seed"]
    out = summarize_rounds(df, n_boot=n_boot, seed=seed)
    out.update(
        n_samples=len(samples),
        n_samples_with_rounds=out["n_samples"],
        gamma=gamma,
        total_new_tokens=sum(s["new_tokens"] for s in samples),
        total_time_s=sum(s["time_s"] for s in samples),
        tokens_per_s=_tokens_per_s(samples),
    )
    out["speedup_vs_plain"] = None
    if baseline_json.exists():
        base = read_json(baseline_json)
        same = all(base.get(k) == cfg["eval"][k] for k in ("temperature", "max_new_tokens"))
        if not same:
            log.warning("%s was made with other eval settings: no speedup_vs_plain", baseline_json)
        elif (base.get("plain") or {}).get("tokens_per_s"):
            out["speedup_vs_plain"] = out["tokens_per_s"] / base["plain"]["tokens_per_s"]
    out["baseline_json"] = str(baseline_json) if baseline_json.exists() else None
    out["confidence_selfcheck"] = confidence_selfcheck(df)
    out["positions"] = position_table(df, gamma=gamma, n_boot=n_boot, seed=seed).to_dict("records")
    out["samples"] = samples
    return out


def cli_evaluate(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec evaluate", description="speculative decoding of a benchmark with a drafter")
    add_config_args(p)
    p.add_argument("--method", required=True, help="eagle3 | dflash | dspark (or an ablation variant name)")
    p.add_argument("--benchmark", required=True)
    p.add_argument("--drafter", help="drafter directory or hub id (default: released checkpoint, else R/T/drafters/<method>)")
    p.add_argument("--out", help="records CSV (default R/T/eval/<method>/<benchmark>.csv); the JSON goes beside it")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from ..drafters import load_drafter
    from .convert import resolve_drafter
    from .target import target_from_config

    paths = RunPaths.of(cfg)
    out_csv = Path(args.out) if args.out else paths.records(args.method, args.benchmark)
    target = target_from_config(cfg)
    prompts = benchmark_prompt_ids(cfg, target, args.benchmark)
    # a released reference checkpoint (hub id or directory) is converted once (deepspec/convert.py)
    path = resolve_drafter(drafter_path(cfg, args.method, args.drafter), target, cfg, method=args.method)
    log.info("target %s, drafter %s, %d prompts of %s", cfg["target"]["name"], path, len(prompts), args.benchmark)
    drafter = load_drafter(path, target).eval()
    domain = cfg["data"]["benchmarks"][args.benchmark]["domain"]
    df, samples = run_evaluation(cfg, target, drafter, prompts, method=args.method, benchmark=args.benchmark, domain=domain)
    gamma = int(df.filter(like="conf_logit_").shape[1]) or int(df["proposal_len"].max())
    summary = summarize(cfg, df, samples, gamma=gamma, baseline_json=paths.baseline(args.benchmark))
    summary = {"target": cfg["target"]["name"], "method": args.method, "benchmark": args.benchmark, "domain": domain,
               "drafter": path, "temperature": cfg["eval"]["temperature"], "max_new_tokens": cfg["eval"]["max_new_tokens"],
               "confidence_threshold": cfg["eval"]["confidence_threshold"], **summary}
    write_csv_atomic(df, out_csv)
    write_json_atomic(out_csv.with_suffix(".json"), json_safe(summary))
    speedup = summary["speedup_vs_plain"]
    log.info("%s/%s: tau %.3f [%.3f, %.3f], %.2f tokens/s, speedup vs plain %s -> %s", args.method, args.benchmark,
             summary["tau"], summary["tau_ci_low"], summary["tau_ci_high"], summary["tokens_per_s"],
             "n/a" if speedup is None else f"{speedup:.3f}x", out_csv)
    return 0


# --------------------------------------------------------------------------- baseline
def run_baselines(cfg: dict, target, prompts, kinds) -> dict[str, list[dict]]:
    from tqdm import tqdm

    from ..core.decode import plain_generate, prompt_lookup_generate

    ev = cfg["eval"]

    def one(kind, idx, ids, max_new):
        if kind == "plain":
            return plain_generate(target, ids, max_new_tokens=max_new, temperature=ev["temperature"],
                                  generator=_generator(cfg, target, idx))
        return prompt_lookup_generate(target, ids, max_new_tokens=max_new, temperature=ev["temperature"],
                                      num_tokens=ev["prompt_lookup_num_tokens"], seed=ev["seed"] + idx)

    out = {}
    for kind in kinds:
        _warmup(lambda: one(kind, 0, prompts[0][1], 4))
        out[kind] = []
        for idx, (p, ids) in enumerate(tqdm(prompts, desc=f"baseline {kind}", unit="prompt")):
            gen = one(kind, idx, ids, ev["max_new_tokens"])
            out[kind].append({"sample_id": p.id, "new_tokens": len(gen.tokens), "time_s": gen.time_s})
    return out


def cli_baseline(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec baseline", description="plain and prompt-lookup decoding baselines")
    add_config_args(p)
    p.add_argument("--benchmark", required=True)
    p.add_argument("--out", help="summary JSON (default R/T/eval/baseline/<benchmark>.json); per-sample CSV beside it")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from .target import target_from_config

    out_json = Path(args.out) if args.out else RunPaths.of(cfg).baseline(args.benchmark)
    target = target_from_config(cfg)
    prompts = benchmark_prompt_ids(cfg, target, args.benchmark)
    runs = run_baselines(cfg, target, prompts, cfg["eval"]["baselines"])
    summary = {"target": cfg["target"]["name"], "benchmark": args.benchmark, "n_samples": len(prompts),
               "temperature": cfg["eval"]["temperature"], "max_new_tokens": cfg["eval"]["max_new_tokens"],
               "prompt_lookup_num_tokens": cfg["eval"]["prompt_lookup_num_tokens"]}
    for kind, samples in runs.items():
        summary[kind] = {"tokens_per_s": _tokens_per_s(samples),
                         "total_new_tokens": sum(s["new_tokens"] for s in samples),
                         "total_time_s": sum(s["time_s"] for s in samples),
                         "new_tokens": [s["new_tokens"] for s in samples]}
        log.info("baseline %s/%s: %.2f tokens/s", kind, args.benchmark, summary[kind]["tokens_per_s"])
    rows = [{"baseline": k, **s} for k, samples in runs.items() for s in samples]
    write_csv_atomic(pd.DataFrame(rows, columns=["baseline", "sample_id", "new_tokens", "time_s"]), out_json.with_suffix(".csv"))
    write_json_atomic(out_json, json_safe(summary))
    return 0


# --------------------------------------------------------------------------- schedule
def cli_schedule(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec schedule", description="threshold sweep, STS calibration, Algorithm 1")
    add_config_args(p)
    p.add_argument("--method", default="dspark")
    p.add_argument("--benchmark", required=True)
    p.add_argument("--records", help="records CSV (default R/T/eval/<method>/<benchmark>.csv)")
    p.add_argument("--max-batch-tokens", type=int, default=16, help="SPS profiled for B = 1..this")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from ..core.acceptance import conf_logits
    from ..core.calibration import apply_sts, split_samples, sts_before_after
    from ..core.decode import profile_target_sps
    from ..core.scheduler import simulate_schedule, threshold_sweep
    from .target import target_from_config

    records = Path(args.records) if args.records else RunPaths.of(cfg).records(args.method, args.benchmark)
    df = pd.read_csv(require_file(records, "evaluation records"))
    x = conf_logits(df)
    if x.shape[1] == 0 or not np.isfinite(x).any():
        raise DeepSpecError(f"{records}: no confidence logits (schedule needs a drafter with a confidence head)")
    if df["sample_id"].nunique() < 2:
        raise DeepSpecError("calibration needs records from at least 2 samples (raise the benchmark cap)")
    if cfg["eval"]["confidence_threshold"] > 0:
        log.warning("records were made with a confidence threshold: the sweep and Algorithm 1 assume full proposals")
    base = records.with_suffix("")
    write_csv_atomic(threshold_sweep(df, cfg["ablations"]["thresholds"]), base.with_suffix(".sweep.csv"))

    A, L = df["accepted"].to_numpy(), df["proposal_len"].to_numpy()
    fit, held = split_samples(df["sample_id"], cfg["eval"]["seed"])
    cal, temps = sts_before_after(x, A, L, fit)
    write_csv_atomic(cal, base.with_suffix(".calibration.csv"))

    gamma = x.shape[1]
    sizes = list(range(1, max(args.max_batch_tokens, gamma + 1) + 1))
    sps = profile_target_sps(target_from_config(cfg), sizes, context_len=min(256, cfg["data"]["max_length"]))
    full = held & (L == gamma) & np.isfinite(x).all(1)  # realised acceptance of full proposals
    c = apply_sts(x[full], temps)
    sims = [{"batch": R, **simulate_schedule(c, A[full], sps, batch=R, seed=cfg["eval"]["seed"])}
            for R in range(1, max(sizes) // (gamma + 1) + 1) if full.sum() >= R]
    alg1 = {"target": cfg["target"]["name"], "method": args.method, "benchmark": args.benchmark, "gamma": gamma,
            "sts_temperatures": temps.tolist(), "n_rounds_fit": int(fit.sum()), "n_rounds_eval": int(full.sum()),
            "sps": {"batch_tokens": sps.batch_tokens.tolist(), "steps_per_s": sps.steps_per_s.tolist()},
            "simulations": sims}
    write_json_atomic(base.with_suffix(".alg1.json"), json_safe(alg1))
    for s in sims:
        log.info("Algorithm 1, %d request(s)/step: %.2f vs fixed %.2f tokens/s (x%.3f), mean verify length %.2f",
                 s["batch"], s["theta_alg1"], s["theta_fixed"], s["speedup_vs_fixed"], s["mean_verify_len"])
    return 0

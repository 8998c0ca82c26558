"""The rules of workflow/rules/evaluate.smk: `evaluate` (speculative decoding
with a drafter) and `baseline` (plain and prompt-lookup decoding); `schedule`
(threshold sweep, STS calibration, Algorithm 1) is in schedule.py. Paper Sec. 4.1-4.2, Figures 5-6;
the protocol of DeepSpec's eval.py.

`evaluate` runs all of a method's benchmarks in one process: the first
eval.speed_prompts prompts of each benchmark are decoded alone by the batch-1
loop (timed: tokens/s, and the speedup over plain decoding of the same prompt
decoded right before or after it, with a paired-bootstrap interval), the others by the batched engine
(core/engine.py) at eval.batch_size with continuous batching across
benchmarks. Every sample keeps its batch-1 seed (eval.seed + index), and the
records are the same per-round rows (plus batch_size and verify_tokens), so tau
and Figure 2 read them unchanged.

Outputs under R/T/eval/ (R = results_dir, T = target name), all written atomically:
  <method>/<benchmark>.csv   one row per round (docs/INTERFACES.md) + method, benchmark, domain
  <method>/<benchmark>.json  summary: tau with CI, per-position table, tokens/s, speedup vs plain,
                             environment (device, dtypes, machine: deepspec.provenance)
  baseline/<benchmark>.json  tokens/s of plain and prompt-lookup decoding (+ per-sample .csv)
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Mapping

import pandas as pd
import torch

from ..config import add_config_args, as_config, config_from_args, rule_settings, settings_fingerprint
from ..data.prompts import benchmark_prompt_set, speed_benchmarks
from ..errors import DeepSpecError
from ..files import ResumableLog, json_safe, write_csv_atomic, write_json_atomic
from ..methods import resolve_method
from ..paths import RunPaths
from ..settings import Eval, Settings

log = logging.getLogger(__name__)


def eval_dtype(cfg) -> str:
    """The dtype evaluation decodes in on this machine: eval.precision, whose auto
    takes bf16 where the hardware multiplies it natively (`runtime.resolve_precision`)
    and eval.dtype elsewhere. `cfg`: a config or Settings."""
    from ..runtime import resolve_precision

    s = Settings.view(cfg)
    got = resolve_precision(s.eval.precision, s.target.device, stage="evaluate")
    return s.eval.dtype if s.eval.precision == "auto" and got == "float32" else got


def eval_target(s: Settings, dtype: str | None = None):
    """The target as evaluation runs it: in `eval_dtype` (bf16 on a GPU or a
    bf16-capable CPU (AMX-BF16 or AVX512-BF16); the paper presets' eval.dtype is bf16 too, as DeepSeek's reference
    evaluates its bf16 checkpoints, docs/FIDELITY.md), or `dtype`."""
    from ..targets.loading import target_from_config

    return target_from_config(s, dtype=dtype or eval_dtype(s))


def eval_drafter(path, target, s: Settings, dtype: str | None = None):
    """A saved drafter (fp32, as trained or converted) loaded for `target` and cast
    to the target's dtype (or `dtype`), in eval mode."""
    from ..drafters import load_drafter

    dt = getattr(torch, dtype) if dtype else next(target.model.parameters()).dtype
    return load_drafter(path, target, s.drafter).to(dt).eval()


def sample_generator(ev: Eval, target, idx: int) -> torch.Generator:
    """The per-sample seed of the reference evaluator: eval.seed + sample index."""
    return torch.Generator(device=target.device).manual_seed(ev.seed + idx)


def drafter_path(cfg, method: str, override: str | None = None) -> str:
    """--drafter, else the method's released checkpoint (eval.released_checkpoints: a
    {hub, revision} snapshot fetched by the DAG's fetch_released, or a local
    directory), else the trained drafter's directory. `cfg`: a config or Settings."""
    from ..fetch import RELEASED_FILES, fetched

    if override:
        return override
    s = Settings.view(cfg)
    released = s.eval.released_checkpoints.get(method)
    if isinstance(released, dict):
        return str(fetched(s, "model", released["hub"], released["revision"], RELEASED_FILES))
    if released:
        if not Path(released).is_dir():
            raise DeepSpecError(f"eval.released_checkpoints.{method}: no directory {released!r} (a checkpoint on "
                                f"the hub is given as {{hub: <id>, revision: <commit>}})")
        return released
    return str(RunPaths.of(s).drafter_dir(method))


def tokens_per_s(samples: list[dict]) -> float:
    """Tokens/s of the batch-1 (timed) samples: batched samples overlap in time."""
    samples = [s for s in samples if s.get("batch1", True)]
    t = sum(s["time_s"] for s in samples)
    return sum(s["new_tokens"] for s in samples) / t if t > 0 else float("nan")


def n_speed(s: Settings, benchmark: str) -> int:
    """How many of a benchmark's first prompts are timed at batch size 1: eval.speed_prompts
    for the timed benchmarks (eval.speed_benchmarks), none for the others."""
    return s.eval.speed_prompts if benchmark in speed_benchmarks(s) else 0


def speed_sample(s: Settings, prompts: list, benchmark: str) -> list:
    """The small fixed sample timed at batch size 1 (speedup vs plain): the first eval.speed_prompts."""
    return prompts[: n_speed(s, benchmark)]


# --------------------------------------------------------------------------- evaluate
class Progress:
    """Every finished request's records, appended (one line, fsync'd) to a partial
    file as it finishes (`files.ResumableLog`), so that a killed evaluate job
    resumes where it stopped: a rerun with the same settings (`progress_header`:
    the evaluate fingerprint, method, drafter, benchmarks) skips the requests in the
    file and reads their records from it; other settings discard it. Removed once
    every output is written. `Progress(None)` keeps nothing."""

    def __init__(self, path: Path | None, header: dict | None = None):
        self.path, self.done, self._log = path, {}, None
        if path is None:
            return
        self._log = ResumableLog(path, header or {})
        self.done = {(r["benchmark"], r["index"]): r for r in self._log.records("evaluation progress").values()}
        if self.done:
            log.info("%s: resuming, %d finished requests kept", path, len(self.done))

    def get(self, benchmark: str, index: int, sample_id: str):
        """The finished request's record, if it was this prompt's."""
        rec = self.done.get((benchmark, index))
        return rec if rec is not None and rec["sample"]["sample_id"] == sample_id else None

    def add(self, benchmark: str, index: int, rows: list, sample: dict) -> None:
        rec = {"id": f"{benchmark}#{index}", "benchmark": benchmark, "index": index, "rows": rows, "sample": sample}
        self.done[(benchmark, index)] = rec
        if self._log is not None:
            self._log.append([rec])

    def finish(self) -> None:
        if self._log is not None:
            self._log.finish()


# How many rows decode at once: a request's records do not depend on it (fixed gamma or a static
# threshold, each request with its own seed), so progress survives a change of these.
ROWS_KEYS = ("batch_size", "kv_budget_gb")


def _without_rows_keys(cfg: Settings | Mapping) -> dict:
    cfg = as_config(cfg)
    return {**cfg, "eval": {k: v for k, v in cfg["eval"].items() if k not in ROWS_KEYS}}


def evaluation_settings(cfg: Settings | Mapping) -> dict:
    """The settings an evaluation's records and summary depend on, recorded in the
    summary (the report checks them against its own config): the evaluate rule's
    settings less ROWS_KEYS."""
    return rule_settings(_without_rows_keys(cfg), "evaluate")


def baseline_settings(cfg: Settings | Mapping) -> dict:
    """The settings a baseline's tokens/s depend on (the baseline rule's), recorded in its JSON."""
    return rule_settings(cfg, "baseline")


def progress_header(cfg: Settings | Mapping, method: str, drafter, benchmarks: list) -> dict:
    """What the records in a partial file depend on: the evaluate rule's settings less
    ROWS_KEYS (a job stopped by an out-of-memory error resumes at a smaller
    eval.batch_size or eval.kv_budget_gb), the method, the drafter, the benchmarks."""
    return {"fingerprint": settings_fingerprint(_without_rows_keys(cfg), "evaluate"), "method": method, "drafter": str(drafter),
            "benchmarks": list(benchmarks)}


def feature_layers(s: Settings, drafter) -> list:
    """The target layers a drafter reads: its config's, else the preset's."""
    return list(getattr(drafter.config, "deepspec_feature_layers", None) or s.target.feature_layers)


def alg1_policy(s: Settings, target, drafter):
    """Algorithm 1 for the timed prompts at batch size 1 (eval.speed_alg1), or None:
    this drafter's confidences (raw sigma(c)) against SPS(1 + l), this machine's
    cost of verifying l drafts in a batch-1 round, profiled here once
    (`decode.profile_target_sps`, a few seconds). Drafters without a confidence
    head get None."""
    from ..core.decode import profile_target_sps
    from ..core.policies import LiveAlgorithm1

    if not s.eval.speed_alg1 or getattr(drafter, "confidence", None) is None:
        return None
    sps = profile_target_sps(target, range(1, drafter.gamma + 2), context_len=min(256, s.data.max_length),
                             feature_layers=feature_layers(s, drafter), seed=s.eval.seed)
    log.info("SPS(1..%d) of a batch-1 round for Algorithm 1: %s steps/s", drafter.gamma + 1,
             " ".join(f"{x:.1f}" for x in sps.steps_per_s))
    return LiveAlgorithm1(sps)


def run_timed(s: Settings, target, drafter, prompts, *, method: str, benchmark: str, domain: str,
              progress: Progress | None = None, alg1=None):
    """Speculative decoding over `prompts`; returns (per-round DataFrame, per-sample list).
    Each prompt is also decoded plainly right before or after it (the speedup's pair)
    and, with `alg1` (`alg1_policy`), a third time between the two with Algorithm 1
    choosing each round's verified length: timed only, its rounds are not records
    (Table 1 and Figure 2 verify full proposals, as the paper's).
    Requests already in `progress` are read from it, the others appended to it."""
    from tqdm import tqdm

    from ..core.decode import plain_generate, speculative_generate

    ev = s.eval
    progress = progress or Progress(None)
    layers = feature_layers(s, drafter)
    rows, samples = [], []

    def spec(idx, ids, max_new, policy=None):
        return speculative_generate(target, drafter, ids, feature_layers=layers, max_new_tokens=max_new,
                                    temperature=ev.temperature, generator=sample_generator(ev, target, idx),
                                    confidence_threshold=ev.confidence_threshold, policy=policy)

    def plain(idx, ids, max_new):
        return plain_generate(target, ids, max_new_tokens=max_new, temperature=ev.temperature,
                              generator=sample_generator(ev, target, idx))

    if any(progress.get(benchmark, i, p.id) is None for i, (p, _) in enumerate(prompts)):
        # one short untimed run of each (kernel selection, allocator, lazy init) before timing
        spec(0, prompts[0][1], 4)
        plain(0, prompts[0][1], 4)
        if alg1 is not None:
            spec(0, prompts[0][1], 4, alg1)
    for idx, (p, ids) in enumerate(tqdm(prompts, desc=f"{method}/{benchmark}", unit="prompt")):
        if (rec := progress.get(benchmark, idx, p.id)) is not None:
            rows += rec["rows"]
            samples.append(rec["sample"])
            continue
        # plain decoding of the same prompt right before or after (alternating), so that the
        # speedup's pairs share the machine's state of the moment (`interleaved_speedup`)
        if idx % 2:
            base = plain(idx, ids, ev.max_new_tokens)
        gen = spec(idx, ids, ev.max_new_tokens)
        sched = None if alg1 is None else spec(idx, ids, ev.max_new_tokens, alg1)
        if not idx % 2:
            base = plain(idx, ids, ev.max_new_tokens)
        mine = [{"sample_id": p.id, **r, "method": method, "benchmark": benchmark, "domain": domain} for r in gen.rounds]
        sample = {"sample_id": p.id, "prompt_tokens": len(ids), "new_tokens": len(gen.tokens),
                  "rounds": len(gen.rounds), "time_s": gen.time_s,
                  "plain_new_tokens": len(base.tokens), "plain_time_s": base.time_s}
        if sched is not None:
            sample.update(alg1_new_tokens=len(sched.tokens), alg1_time_s=sched.time_s, alg1_rounds=len(sched.rounds),
                          alg1_verified=sum(r["proposal_len"] for r in sched.rounds))
        progress.add(benchmark, idx, mine, sample)
        rows += mine
        samples.append(sample)
        log.info("%s: %d tokens in %d rounds, %.2f s%s", p.id, len(gen.tokens), len(gen.rounds), gen.time_s,
                 "" if sched is None else f"; Algorithm 1: {len(sched.tokens)} tokens in {len(sched.rounds)} rounds, "
                                          f"{sched.time_s:.2f} s")
    if not rows:
        raise DeepSpecError(f"{method}/{benchmark}: no speculative rounds: every sample ended on its first token "
                            "(an EOS, or eval.max_new_tokens < 2)")
    return pd.DataFrame(rows), samples


def interleaved_speedup(samples: list[dict], n_boot: int, seed: int, policy: str = "fixed",
                        strata: list | None = None) -> dict | None:
    """Speculative over plain decoding tokens/s on the batch-1 samples that were
    decoded both ways back to back (`run_timed`): the ratio of the pooled rates,
    sum(tokens) / sum(time) each, and its 95 % interval from a paired bootstrap
    over the samples (both sides of a sample resampled together). policy "alg1":
    the same for the samples' Algorithm 1 decoding. `strata` (one label per sample,
    e.g. its benchmark: a fixed number of prompts from each) makes the bootstrap
    stratified, n_h - 1 draws from each stratum's n_h samples (Rao and Wu's
    rescaling, which gives the design's variance: n_h draws would understate it by
    (n_h - 1) / n_h); with a stratum of one sample it is the plain bootstrap.
    One sample has no interval (NaN bounds). None without such samples."""
    import numpy as np

    pre = "" if policy == "fixed" else f"{policy}_"
    keep = [i for i, s in enumerate(samples)
            if s.get("batch1", True) and s.get("plain_time_s") and s.get(f"{pre}time_s")]
    if not keep:
        return None
    pairs = [samples[i] for i in keep]
    x = np.array([[s[f"{pre}new_tokens"], s[f"{pre}time_s"], s["plain_new_tokens"], s["plain_time_s"]] for s in pairs],
                 dtype=float)

    def ratio(a):
        return (a[..., 0].sum(-1) / a[..., 1].sum(-1)) / (a[..., 2].sum(-1) / a[..., 3].sum(-1))

    rng = np.random.default_rng(seed)
    groups = None
    if strata is not None:
        labels = [strata[i] for i in keep]
        groups = [np.flatnonzero([lb == g for lb in labels]) for g in dict.fromkeys(labels)]
        groups = groups if min(map(len, groups)) >= 2 else None
    if groups is None:
        idx = rng.integers(0, len(x), (n_boot, len(x)))
    else:
        idx = np.concatenate([g[rng.integers(0, len(g), (n_boot, len(g) - 1))] for g in groups], axis=1)
    boot = ratio(x[idx])
    # one prompt has no interval (its bootstrap would repeat the point)
    lo, hi = (np.quantile(boot, 0.025), np.quantile(boot, 0.975)) if len(x) >= 2 else (np.nan, np.nan)
    out = {"speedup": float(ratio(x)), "ci_low": float(lo), "ci_high": float(hi), "n_samples": len(x),
           "plain_tokens_per_s": float(x[:, 2].sum() / x[:, 3].sum()),
           "bootstrap": "plain" if groups is None else f"stratified over {len(groups)} strata"}
    if policy == "alg1":  # drafts verified per round: the lengths Algorithm 1 chose
        out["mean_verified"] = sum(s["alg1_verified"] for s in pairs) / max(1, sum(s["alg1_rounds"] for s in pairs))
    return out


def summarize(ev: Eval, df: pd.DataFrame, samples: list[dict], *, gamma: int) -> dict:
    from ..core.acceptance import confidence_selfcheck, position_table, summarize_rounds

    n_boot, seed = ev.n_boot, ev.seed
    out = summarize_rounds(df, n_boot=n_boot, seed=seed)
    out.update(
        n_samples=len(samples),
        n_samples_with_rounds=out["n_samples"],
        gamma=gamma,
        total_new_tokens=sum(s["new_tokens"] for s in samples),
        total_time_s=sum(s["time_s"] for s in samples),
        tokens_per_s=tokens_per_s(samples),
    )
    # plain decoding of each timed prompt, timed beside it in this process (run_timed)
    inter = interleaved_speedup(samples, n_boot, seed)
    out["speedup_interleaved"] = inter
    out["speedup_vs_plain"] = None if inter is None else inter["speedup"]
    out["speedup_alg1"] = interleaved_speedup(samples, n_boot, seed, "alg1")  # None unless eval.speed_alg1 ran
    out["confidence_selfcheck"] = confidence_selfcheck(df)
    out["positions"] = position_table(df, gamma=gamma, n_boot=n_boot, seed=seed).to_dict("records")
    out["samples"] = samples
    return out


def run_batched(s: Settings, target, drafter, bench_prompts: dict, *, method: str, skip: dict,
                progress: Progress | None = None):
    """Every prompt of every benchmark b but its first skip[b] through one
    BatchedEngine at eval.batch_size (fixed gamma, or the static threshold when
    eval.confidence_threshold > 0). Returns ({benchmark: (records, samples)}, engine info)."""
    from ..core.engine import BatchedEngine, Request, padding_share
    from ..core.policies import FixedGamma, StaticThreshold

    ev = s.eval
    progress = progress or Progress(None)
    thr = ev.confidence_threshold
    todo = [(b, i, p, ids) for b, prompts in bench_prompts.items() for i, (p, ids) in enumerate(prompts) if i >= skip[b]]
    budget = None if ev.kv_budget_gb is None else ev.kv_budget_gb * 2**30
    engine = BatchedEngine(target, drafter, feature_layers=feature_layers(s, drafter), temperature=ev.temperature,
                           policy=StaticThreshold(thr) if thr > 0 else FixedGamma(), max_batch=ev.batch_size,
                           kv_budget_bytes=budget)
    out = {b: ([], []) for b in bench_prompts}

    def keep(b, i, rows, sample):
        out[b][0].extend({**r, "_i": i} for r in rows)
        out[b][1].append({**sample, "_i": i})

    reqs = []
    for b, i, p, ids in todo:
        if (rec := progress.get(b, i, p.id)) is not None:  # finished by an earlier, interrupted run
            keep(b, i, rec["rows"], rec["sample"])
        else:
            reqs.append(Request((b, i, p.id), ids, ev.max_new_tokens, seed=ev.seed + i))
    reqs.sort(key=lambda r: len(r.prompt_ids))  # similar lengths share the padded batch (outputs do not depend on it)

    def finished(f):
        b, i, pid = f.request.request_id
        domain = s.data.benchmarks[b]["domain"]
        rows = [{"sample_id": pid, **r, "method": method, "benchmark": b, "domain": domain} for r in f.rounds]
        sample = {"sample_id": pid, "prompt_tokens": len(f.request.prompt_ids), "new_tokens": len(f.tokens),
                  "rounds": len(f.rounds), "time_s": f.time_s, "batch1": False}
        progress.add(b, i, rows, sample)
        keep(b, i, rows, sample)
        new_tokens[0] += len(f.tokens)

    new_tokens = [0]
    t0 = time.perf_counter()
    engine.generate(reqs, on_finish=finished)
    wall = time.perf_counter() - t0
    # kv_budget_gb as the preset wrote it (48, not 48.0: the JSON is unchanged)
    info = {"batch_size": ev.batch_size, "kv_budget_gb": s.as_written("eval", "kv_budget_gb"), "requests": len(todo),
            "resumed_requests": len(todo) - len(reqs), "wall_s": wall, **engine.stats,
            "padding_share": padding_share(engine.stats)}
    info["tokens_per_s"] = new_tokens[0] / wall if reqs else None
    log.info("engine: %d requests at batch %d (at most %d rows at once) in %.1f s, %d rounds", len(reqs),
             ev.batch_size, engine.stats["max_rows"], wall, engine.stats["rounds"])
    res = {}
    for b, (rows, samples) in out.items():  # batch-1 order: by sample index, then round
        rows.sort(key=lambda r: (r["_i"], r["round"]))
        samples.sort(key=lambda x: x["_i"])
        res[b] = (pd.DataFrame(rows).drop(columns="_i", errors="ignore"), [{k: v for k, v in x.items() if k != "_i"}
                                                                            for x in samples])
    return res, info


def run_method(s: Settings, target, drafter, bench_prompts: dict, *, method: str, progress: Progress | None = None):
    """All benchmarks of a method: the speed sample of each at batch size 1
    (`run_timed`), the rest batched (`run_batched`). Returns
    ({benchmark: (records DataFrame, samples)}, engine info)."""
    out, alg1 = {}, None
    speeds = {b: speed_sample(s, prompts, b) for b, prompts in bench_prompts.items()}
    if any(speeds.values()):
        alg1 = alg1_policy(s, target, drafter)
    for b, speed in speeds.items():
        domain = s.data.benchmarks[b]["domain"]
        out[b] = run_timed(s, target, drafter, speed, method=method, benchmark=b, domain=domain,
                           progress=progress, alg1=alg1) if speed else (pd.DataFrame(), [])
    batched, info = run_batched(s, target, drafter, bench_prompts, method=method,
                                skip={b: n_speed(s, b) for b in bench_prompts}, progress=progress)
    for b, (df, samples) in batched.items():
        df0, s0 = out[b]
        df = pd.concat([d for d in (df0, df) if len(d)], ignore_index=True) if len(df0) or len(df) else df0
        if not len(df):
            raise DeepSpecError(f"{method}/{b}: no speculative rounds (every sample ended on its first token)")
        out[b] = (df, s0 + samples)
    return out, info


def _write_benchmark(s: Settings, method: str, bench: str, df, samples, out_csv: Path, drafter_src: str, engine: dict,
                     skipped: list, environment: dict | None = None):
    """Summary JSON (tau with CI, positions, tokens/s of the batch-1 sample, speedup) beside the records."""
    domain = s.data.benchmarks[bench]["domain"]
    gamma = int(df.filter(like="conf_logit_").shape[1]) or int(df["proposal_len"].max())
    summary = summarize(s.eval, df, samples, gamma=gamma)
    # temperature and confidence_threshold as the preset wrote them (1, not 1.0: the JSON is unchanged)
    summary = {"target": s.target.name, "method": method, "benchmark": bench, "domain": domain,
               "drafter": drafter_src, "temperature": s.as_written("eval", "temperature"),
               "max_new_tokens": s.eval.max_new_tokens,
               "confidence_threshold": s.as_written("eval", "confidence_threshold"), "engine": engine,
               "environment": environment, **skipped_fields(s, skipped), **summary,
               "settings": evaluation_settings(s)}
    write_csv_atomic(df, out_csv)
    write_json_atomic(out_csv.with_suffix(".json"), json_safe(summary))
    speedup = summary["speedup_vs_plain"]
    log.info("%s/%s: tau %.3f [%.3f, %.3f], %.2f tokens/s (batch 1), speedup vs plain %s -> %s", method, bench,
             summary["tau"], summary["tau_ci_low"], summary["tau_ci_high"], summary["tokens_per_s"],
             "n/a" if speedup is None else f"{speedup:.3f}x", out_csv)


def skipped_fields(s: Settings, skipped: list) -> dict:
    """How many of the benchmark's prompts were over data.max_prompt_tokens and left out (prompts.benchmark_prompt_set)."""
    return {"max_prompt_tokens": s.data.max_prompt_tokens, "n_skipped_prompts": len(skipped),
            "skipped_prompts": skipped}


def cli_evaluate(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec evaluate", description="speculative decoding of a benchmark with a drafter")
    add_config_args(p)
    p.add_argument("--method", required=True, help="eagle3 | dflash | dspark (or an ablation variant name)")
    p.add_argument("--benchmark", action="append", help="repeatable (default: every benchmark of the preset)")
    p.add_argument("--drafter", help="drafter directory or hub id (default: released checkpoint, else R/T/drafters/<method>)")
    p.add_argument("--out", help="records CSV of a single --benchmark (default R/T/eval/<method>/<benchmark>.csv); "
                                 "the JSON goes beside it")
    p.add_argument("--out-dir", help="directory for <benchmark>.csv and .json (default R/T/eval/<method>/)")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    from ..formats.released import resolve_drafter
    from ..provenance import evaluation_environment

    base, _ = resolve_method(s, args.method)  # an unknown method is one line, before any work
    paths = RunPaths.of(s)
    benches = args.benchmark or list(s.data.benchmarks)
    if args.out and len(benches) != 1:
        raise DeepSpecError("--out names one records file: give one --benchmark, or use --out-dir")
    outs = {b: Path(args.out) if args.out else (Path(args.out_dir) / f"{b}.csv" if args.out_dir
                                                 else paths.records(args.method, b)) for b in benches}
    target = eval_target(s)  # eval.precision (bf16 where native), else eval.dtype
    sets = {b: benchmark_prompt_set(s, target, b) for b in benches}
    bench_prompts = {b: kept for b, (kept, _) in sets.items()}
    # a released reference checkpoint (hub id or directory) is converted once (deepspec/formats/convert.py)
    path = resolve_drafter(drafter_path(s, args.method, args.drafter), target, s, method=args.method)
    log.info("target %s, drafter %s, %d prompts of %s", s.target.name, path,
             sum(map(len, bench_prompts.values())), ", ".join(benches))
    drafter = eval_drafter(path, target, s)  # its layers as drafter.layer_arch builds them, in the target's dtype
    if drafter.method != base:
        raise DeepSpecError(f"{path} is a {drafter.method} drafter, not {base} (--method {args.method})")
    # finished requests are kept as they finish; a rerun after a kill resumes from them (Progress)
    progress = Progress(outs[benches[0]].parent / f".{args.method}.partial.jsonl",
                        progress_header(s, args.method, path, benches))
    results, engine = run_method(s, target, drafter, bench_prompts, method=args.method, progress=progress)
    environment = evaluation_environment(target, drafter)  # dtypes, device, machine (the provenance record's)
    for b, (df, samples) in results.items():
        _write_benchmark(s, args.method, b, df, samples, outs[b], path, engine, sets[b][1], environment)
    progress.finish()
    return 0






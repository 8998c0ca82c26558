"""The baseline rule (workflow/rules/evaluate.smk): plain and prompt-lookup
decoding of each timed benchmark's first eval.speed_prompts prompts, one prompt
at a time, in evaluate's dtype. Output: R/T/eval/baseline/<benchmark>.json
(tokens/s per kind) and the per-sample .csv beside it."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pandas as pd

from ..config import add_config_args, config_from_args
from ..data.prompts import benchmark_prompt_set, speed_benchmarks
from ..errors import DeepSpecError
from ..files import json_safe, write_csv_atomic, write_json_atomic
from ..paths import RunPaths
from ..settings import Settings
from .evaluate import baseline_settings, eval_target, sample_generator, skipped_fields, speed_sample, tokens_per_s

log = logging.getLogger(__name__)


def run_baselines(s: Settings, target, prompts, kinds, *, warmup: bool = True) -> dict[str, list[dict]]:
    """Each baseline kind over `prompts`, timed one prompt at a time (after one
    short untimed run of each kind, unless this process has made it already)."""
    from tqdm import tqdm

    from ..core.decode import plain_generate, prompt_lookup_generate

    ev = s.eval

    def one(kind, idx, ids, max_new):
        if kind == "plain":
            return plain_generate(target, ids, max_new_tokens=max_new, temperature=ev.temperature,
                                  generator=sample_generator(ev, target, idx))
        return prompt_lookup_generate(target, ids, max_new_tokens=max_new, temperature=ev.temperature,
                                      num_tokens=ev.prompt_lookup_num_tokens, seed=ev.seed + idx)

    out = {}
    for kind in kinds:
        if warmup:
            one(kind, 0, prompts[0][1], 4)  # untimed: kernel selection, allocator, lazy init
        out[kind] = []
        for idx, (p, ids) in enumerate(tqdm(prompts, desc=f"baseline {kind}", unit="prompt")):
            gen = one(kind, idx, ids, ev.max_new_tokens)
            out[kind].append({"sample_id": p.id, "new_tokens": len(gen.tokens), "time_s": gen.time_s})
    return out



def cli_baseline(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec baseline", description="plain and prompt-lookup decoding baselines")
    add_config_args(p)
    p.add_argument("--benchmark", action="append", help="repeatable (default: every timed benchmark, eval.speed_benchmarks)")
    p.add_argument("--out-dir", help="directory for <benchmark>.json and .csv (default R/T/eval/baseline/)")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    timed = speed_benchmarks(s)
    benches = args.benchmark or timed
    for b in benches:
        if b not in timed:
            raise DeepSpecError(f"--benchmark {b}: not a timed benchmark of this preset ({', '.join(timed)}; "
                                "eval.speed_benchmarks)")
    paths = RunPaths.of(s)
    target = eval_target(s)  # in evaluate's dtype
    # one process for every benchmark: the start-up (~7 s) and the warm-up are paid once
    for i, bench in enumerate(benches):
        out_json = Path(args.out_dir) / f"{bench}.json" if args.out_dir else paths.baseline(bench)
        _write_baseline(s, target, bench, out_json, warmup=i == 0)
    return 0



def _write_baseline(s: Settings, target, bench: str, out_json: Path, *, warmup: bool) -> None:
    kept, skipped = benchmark_prompt_set(s, target, bench)
    prompts = speed_sample(s, kept, bench)
    runs = run_baselines(s, target, prompts, s.eval.baselines, warmup=warmup)
    # temperature as the preset wrote it (1, not 1.0: the JSON is unchanged)
    summary = {"target": s.target.name, "benchmark": bench, "n_samples": len(prompts), **skipped_fields(s, skipped),
               "sample_ids": [p.id for p, _ in prompts],
               "temperature": s.as_written("eval", "temperature"), "max_new_tokens": s.eval.max_new_tokens,
               "prompt_lookup_num_tokens": s.eval.prompt_lookup_num_tokens, "settings": baseline_settings(s)}
    for kind, samples in runs.items():
        summary[kind] = {"tokens_per_s": tokens_per_s(samples),
                         "total_new_tokens": sum(x["new_tokens"] for x in samples),
                         "total_time_s": sum(x["time_s"] for x in samples),
                         "new_tokens": [x["new_tokens"] for x in samples]}
        log.info("baseline %s/%s: %.2f tokens/s", kind, bench, summary[kind]["tokens_per_s"])
    rows = [{"baseline": k, **x} for k, samples in runs.items() for x in samples]
    write_csv_atomic(pd.DataFrame(rows, columns=["baseline", "sample_id", "new_tokens", "time_s"]), out_json.with_suffix(".csv"))
    write_json_atomic(out_json, json_safe(summary))

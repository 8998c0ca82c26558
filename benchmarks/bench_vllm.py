"""Our decoding and vLLM's side by side, in ONE run, on the same target, prompts
and Eagle3 drafter, greedy: tokens/s of plain and speculative decoding at each
concurrency (1 = batch 1; c > 1 = waves of c concurrent requests), the speedups
and tau on both sides (issue 31, item 5; docs/PERFORMANCE.md).

    python benchmarks/bench_vllm.py --preset smollm2-135m-overfit [--drafter DIR] [--n 16]
        [--max-new 64] [--concurrency 1,4,16] [--threads 2] [--vllm-compile] [--skip-vllm]

The drafter is --drafter, else the preset's trained Eagle3 (results/<...>/drafters/eagle3;
the smollm2-135m-overfit preset makes one over-fitted to the benchmark prompts, so
that all 7 draft positions are exercised). It is exported for vLLM
(`export-checkpoint --format eagle3 --engine vllm`, into <drafter>-vllm) and vLLM
loads the prepared target checkpoint (resources/targets/<name>, `prepare-target`).
vLLM runs in its own Python (env DEEPSPEC_VLLM_PYTHON, else /work/vllm-venv/bin/python)
through benchmarks/vllm_bench_worker.py, with `speculative_config={"method":
"eagle3", "model": DIR, "num_speculative_tokens": gamma}` and the same number of
threads (VLLM_CPU_OMP_THREADS_BIND); enforce_eager unless --vllm-compile.
Our side runs first, then vLLM's plain and speculative engines, one after another
(never at the same time): on a shared machine compare ratios, not absolute rates.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepspec.config import load_config, parse_set
from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.engine import BatchedEngine, Request
from deepspec.data.prompts import benchmark_prompt_ids
from deepspec.drafters import load_drafter
from deepspec.evaluation.evaluate import drafter_path
from deepspec.paths import RunPaths
from deepspec.targets.loading import target_from_config

WORKER = Path(__file__).with_name("vllm_bench_worker.py")


def vllm_python() -> str:
    return os.environ.get("DEEPSPEC_VLLM_PYTHON") or "/work/vllm-venv/bin/python"


def ours(target, drafter, prompts, max_new, conc):
    """{concurrency: (tokens/s, tau or None, outputs)} of plain (drafter None) or speculative greedy decoding."""
    layers = None if drafter is None else drafter.config.deepspec_feature_layers
    warm = prompts[0]
    if drafter is None:
        plain_generate(target, warm, max_new_tokens=4, temperature=0.0)
    else:
        speculative_generate(target, drafter, warm, feature_layers=layers, max_new_tokens=4, temperature=0.0)
    res = {}
    for c in conc:
        outs, rounds = [], []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), c):  # waves of c concurrent requests, as the vLLM worker runs them
            wave = prompts[i : i + c]
            if c == 1 and drafter is None:
                outs.append(plain_generate(target, wave[0], max_new_tokens=max_new, temperature=0.0).tokens)
            elif c == 1:
                g = speculative_generate(target, drafter, wave[0], feature_layers=layers, max_new_tokens=max_new,
                                         temperature=0.0)
                outs.append(g.tokens)
                rounds += g.rounds
            else:
                eng = BatchedEngine(target, drafter, feature_layers=layers or [], temperature=0.0, max_batch=c)
                done = sorted(eng.generate([Request(j, ids, max_new) for j, ids in enumerate(wave)]),
                              key=lambda f: f.request.request_id)
                outs += [f.tokens for f in done]
                rounds += [r for f in done for r in f.rounds]
        dt = time.perf_counter() - t0
        tau = sum(r["emitted"] for r in rounds) / len(rounds) if rounds else None
        res[c] = (sum(len(o) for o in outs) / dt, tau, outs)
        print(f"ours {'plain' if drafter is None else 'spec'} c={c}: {res[c][0]:.2f} tok/s, tau {tau}", file=sys.stderr,
              flush=True)
    return res


def theirs(target_dir, export, prompts, max_new, conc, gamma, threads, compile_):
    """The worker's answer for plain (export None) or speculative decoding."""
    with tempfile.TemporaryDirectory() as tmp:
        req = {"target": str(target_dir), "prompts": prompts, "max_tokens": max_new, "concurrency": conc,
               "threads": threads, "enforce_eager": not compile_, "max_model_len": 2048,
               "speculative_config": None if export is None else {"method": "eagle3", "model": str(export),
                                                                  "num_speculative_tokens": int(gamma)}}
        Path(tmp, "req.json").write_text(json.dumps(req))
        subprocess.run([vllm_python(), str(WORKER), str(Path(tmp, "req.json")), str(Path(tmp, "ans.json"))], check=True)
        return json.loads(Path(tmp, "ans.json").read_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m-overfit")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--benchmark", default="gsm8k")
    p.add_argument("--drafter")
    p.add_argument("--n", type=int, default=16, help="prompts")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-compile", action="store_true", help="let vLLM compile its model (default: enforce_eager)")
    p.add_argument("--skip-vllm", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, parse_set(args.overrides))
    conc = [int(c) for c in args.concurrency.split(",")]
    target = target_from_config(cfg)
    prompts = [ids for _, ids in benchmark_prompt_ids(cfg, target, args.benchmark)[: args.n]]
    src = args.drafter or drafter_path(cfg, "eagle3")
    drafter = load_drafter(src, target).eval()
    mine = {"plain": ours(target, None, prompts, args.max_new, conc),
            "spec": ours(target, drafter, prompts, args.max_new, conc)}
    same = sum(a == b for a, b in zip(mine["plain"][1][2], mine["spec"][1][2]))
    vl = None
    if not args.skip_vllm:
        from deepspec.interop.export import export_drafter

        export = Path(str(src).rstrip("/") + "-vllm")
        export_drafter(drafter, target, "eagle3", export, overwrite=True, engine="vllm")
        tdir = RunPaths.of(cfg).target_checkpoint()
        vl = {"plain": theirs(tdir, None, prompts, args.max_new, conc, drafter.gamma, args.threads, args.vllm_compile),
              "spec": theirs(tdir, export, prompts, args.max_new, conc, drafter.gamma, args.threads, args.vllm_compile)}
    print(f"\n{cfg['target']['name']} / {args.benchmark}: {len(prompts)} prompts x {args.max_new} new tokens, greedy, "
          f"Eagle3 gamma {drafter.gamma} ({src}), {args.threads} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"our greedy speculative outputs equal to our plain ones at batch 1: {same}/{len(prompts)}")
    if vl:
        eq = sum(a == b for a, b in zip(vl["plain"]["outputs"], mine["plain"][1][2]))
        print(f"vLLM {vl['spec']['vllm_version']} (load {vl['plain']['load_s']:.0f} / {vl['spec']['load_s']:.0f} s); "
              f"vLLM plain outputs equal to ours: {eq}/{len(prompts)}")
    print(f"{'conc':>4} | {'ours plain':>10} {'ours spec':>9} {'speedup':>7} {'tau':>5} | "
          f"{'vLLM plain':>10} {'vLLM spec':>9} {'speedup':>7} {'tau':>5} | {'ours/vLLM speedup':>17}")
    for i, c in enumerate(conc):
        op, os_, ot = mine["plain"][c][0], mine["spec"][c][0], mine["spec"][c][1]
        row = f"{c:>4} | {op:>10.2f} {os_:>9.2f} {os_ / op:>6.2f}x {ot:>5.2f} | "
        if vl:
            vp, vs = vl["plain"]["runs"][i], vl["spec"]["runs"][i]
            vt = vs["tau"] or float("nan")
            sp = vs["tokens_per_s"] / vp["tokens_per_s"]
            row += f"{vp['tokens_per_s']:>10.2f} {vs['tokens_per_s']:>9.2f} {sp:>6.2f}x {vt:>5.2f} | {os_ / op / sp:>16.2f}x"
        print(row)


if __name__ == "__main__":
    main()

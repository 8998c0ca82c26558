"""Our decoding and vLLM's side by side, in ONE run, on the same target, prompts
and Eagle3 drafter, greedy: tokens/s of plain and speculative decoding at each
concurrency (1 = batch 1; c > 1 = waves of c concurrent requests), the speedups
and tau on both sides (issue 31, item 5; docs/PERFORMANCE.md).

    python benchmarks/bench_vllm.py --preset smollm2-135m-overfit [--set target.cpu_matmul=torch]
        [--drafter DIR] [--n 16] [--max-new 64] [--concurrency 1,4,16] [--repeats 1] [--threads 2]
        [--vllm-compile] [--skip-vllm]

The drafter is --drafter, else the preset's trained Eagle3 (results/<...>/drafters/eagle3;
the smollm2-135m-overfit preset makes one over-fitted to the benchmark prompts, so
that all 7 draft positions are exercised). It is exported for vLLM
(`export-checkpoint --format eagle3 --engine vllm`, into <drafter>-vllm) and vLLM
loads the prepared target checkpoint (resources/targets/<name>, `prepare-target`).
vLLM runs in its own Python (env DEEPSPEC_VLLM_PYTHON, else .venv-vllm/bin/python)
as two engines kept loaded (benchmarks/vllm_bench_worker.py): plain, and with
`speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": gamma}`,
both at the same number of threads (VLLM_CPU_OMP_THREADS_BIND); enforce_eager
unless --vllm-compile.

Interleaved, so that a machine whose speed drifts (machines of one kind differ by
up to 2x, and one machine by 20 % from minute to minute) cannot favour a side: each
wave of prompts is decoded by our plain loop, our speculative loop, vLLM's plain
engine and vLLM's speculative one in turn (one at a time, never at once; the order
reversed every other wave), and tokens/s are totals over the waves. The last
column, our speedup over vLLM's, comes with a 95 % bootstrap interval over waves.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deepspec.config import load_config, parse_set
from deepspec.core.acceptance import bootstrap_weights
from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.engine import BatchedEngine, Request
from deepspec.data.prompts import benchmark_prompt_ids
from deepspec.drafters import load_drafter
from deepspec.evaluation.evaluate import drafter_path
from deepspec.paths import RunPaths
from deepspec.targets.loading import target_from_config

WORKER = Path(__file__).with_name("vllm_bench_worker.py")
MODES = ("ours plain", "ours spec", "vLLM plain", "vLLM spec")


def vllm_python() -> str:
    return os.environ.get("DEEPSPEC_VLLM_PYTHON") or str(Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python")


class VLLMEngine:
    """A vllm_bench_worker.py process: one loaded vLLM engine that decodes the waves it is sent."""

    def __init__(self, request: dict):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "req.json").write_text(json.dumps(request))
            self.proc = subprocess.Popen([vllm_python(), str(WORKER), str(Path(tmp, "req.json"))], text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.info = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the vLLM worker exited with {self.proc.wait()} (its log is above)")
        return json.loads(line)

    def wave(self, prompts, max_new) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_new}) + "\n")
        self.proc.stdin.flush()
        a = self._answer()
        return {"time_s": a["time_s"], "outputs": a["outputs"], "drafts": a["drafts"], "accepted": a["accepted"]}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def ours_wave(target, drafter, wave, max_new) -> dict:
    """Plain (drafter None) or speculative greedy decoding of one wave: the batch-1
    loop for one prompt, the batched engine for several."""
    layers = None if drafter is None else drafter.config.deepspec_feature_layers
    t0 = time.perf_counter()
    if len(wave) == 1 and drafter is None:
        gens = [plain_generate(target, wave[0], max_new_tokens=max_new, temperature=0.0)]
    elif len(wave) == 1:
        gens = [speculative_generate(target, drafter, wave[0], feature_layers=layers, max_new_tokens=max_new,
                                     temperature=0.0)]
    else:
        eng = BatchedEngine(target, drafter, feature_layers=layers or [], temperature=0.0, max_batch=len(wave))
        gens = sorted(eng.generate([Request(j, ids, max_new) for j, ids in enumerate(wave)]),
                      key=lambda f: f.request.request_id)
    rounds = [r for g in gens for r in g.rounds]
    return {"time_s": time.perf_counter() - t0, "outputs": [list(g.tokens) for g in gens],
            "drafts": len(rounds), "accepted": sum(r["emitted"] - 1 for r in rounds), "rounds": rounds}


def summary(waves: list[dict]) -> dict:
    """Totals of one mode over its waves: tokens/s, tau, per-wave tokens and seconds."""
    toks = np.array([sum(len(o) for o in w["outputs"]) for w in waves], dtype=float)
    secs = np.array([w["time_s"] for w in waves])
    drafts, acc = sum(w["drafts"] for w in waves), sum(w["accepted"] for w in waves)
    return {"tps": toks.sum() / secs.sum(), "tau": 1 + acc / drafts if drafts else float("nan"), "toks": toks,
            "secs": secs, "outputs": [o for w in waves for o in w["outputs"]]}


def ratio_interval(s: dict, n_boot: int = 2000):
    """95 % bootstrap interval over waves of (ours spec/plain) / (vLLM spec/plain)."""
    n = len(s["ours plain"]["toks"])
    if n < 4:
        return None
    w = bootstrap_weights(n, n_boot, seed=0)
    tps = {m: (w @ s[m]["toks"]) / (w @ s[m]["secs"]) for m in MODES}
    r = (tps["ours spec"] / tps["ours plain"]) / (tps["vLLM spec"] / tps["vLLM plain"])
    return np.quantile(r, [0.025, 0.975])


def run(target, drafter, engines, prompts, max_new, conc, pause, repeats) -> dict:
    """{concurrency: {mode: summary}}: every wave through every mode in turn, `repeats` passes over the prompts."""
    modes = {"ours plain": lambda w: ours_wave(target, None, w, max_new),
             "ours spec": lambda w: ours_wave(target, drafter, w, max_new)}
    for name, eng in engines.items():
        modes[name] = lambda w, eng=eng: eng.wave(w, max_new)
    for fn in modes.values():  # warm-up
        fn(prompts[:1])
    out = {}
    for c in conc:
        got = {m: [] for m in modes}
        starts = [i for _ in range(repeats) for i in range(0, len(prompts), c)]
        for i, start in enumerate(starts):
            for m in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                time.sleep(pause)  # no process's spinning threads reach into the next one's time
                got[m].append(modes[m](prompts[start : start + c]))
        out[c] = {m: summary(v) for m, v in got.items()}
        print(f"c={c}: " + ", ".join(f"{m} {s['tps']:.2f} tok/s" for m, s in out[c].items()), file=sys.stderr, flush=True)
        rounds = [r for w in got["ours spec"] for r in w["rounds"]]
        out[c]["draft_ms"] = 1000 * sum(r["draft_time_s"] for r in rounds) / len(rounds)
        out[c]["verify_ms"] = 1000 * sum(r["verify_time_s"] for r in rounds) / len(rounds)
    return out


def report(res, cfg, args, drafter, src, engines, n):
    first = res[min(res)]
    same = lambda a, b: sum(x == y for x, y in zip(first[a]["outputs"][:n], first[b]["outputs"][:n]))  # noqa: E731
    print(f"\n{cfg['target']['name']} / {args.benchmark}: {n} prompts x {args.max_new} new tokens, greedy, "
          f"Eagle3 gamma {drafter.gamma} ({src}), {args.threads} threads, {os.cpu_count()} CPUs, target.cpu_matmul "
          f"{cfg['target']['cpu_matmul']}, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"interleaved waves, {args.repeats} pass(es)")
    print(f"outputs equal to our plain greedy ones: ours spec {same('ours plain', 'ours spec')}/{n}" +
          "".join(f", {m} {same('ours plain', m)}/{n}" for m in engines))
    if engines:
        e = engines["vLLM spec"].info
        print(f"vLLM {e['vllm_version']} (loaded in {engines['vLLM plain'].info['load_s']:.0f} / {e['load_s']:.0f} s)")
    head = f"{'conc':>4} | {'ours plain':>10} {'ours spec':>9} {'speedup':>7} {'tau':>5} {'draft/verify ms':>15}"
    print(head + (f" | {'vLLM plain':>10} {'vLLM spec':>9} {'speedup':>7} {'tau':>5} | ours/vLLM speedup (95 % CI)"
                  if engines else ""))
    for c, s in res.items():
        op, os_ = s["ours plain"]["tps"], s["ours spec"]["tps"]
        row = (f"{c:>4} | {op:>10.2f} {os_:>9.2f} {os_ / op:>6.2f}x {s['ours spec']['tau']:>5.2f} "
               f"{s['draft_ms']:>7.1f}/{s['verify_ms']:<7.1f}")
        if engines:
            vp, vs = s["vLLM plain"]["tps"], s["vLLM spec"]["tps"]
            ci = ratio_interval(s)
            row += (f" | {vp:>10.2f} {vs:>9.2f} {vs / vp:>6.2f}x {s['vLLM spec']['tau']:>5.2f} | "
                    f"{os_ / op / (vs / vp):.2f}x" + ("" if ci is None else f" ({ci[0]:.2f}-{ci[1]:.2f})"))
        print(row)


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
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (a tighter interval)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between two measured waves")
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
    engines = {}
    if not args.skip_vllm:
        from deepspec.formats.export import export_drafter

        export = Path(str(src).rstrip("/") + "-vllm")
        export_drafter(drafter, target, "eagle3", export, overwrite=True, engine="vllm")
        req = {"target": str(RunPaths.of(cfg).target_checkpoint()), "threads": args.threads, "max_model_len": 2048,
               "enforce_eager": not args.vllm_compile, "max_num_seqs": max(conc)}
        engines["vLLM plain"] = VLLMEngine({**req, "speculative_config": None})
        engines["vLLM spec"] = VLLMEngine({**req, "speculative_config": {
            "method": "eagle3", "model": str(export), "num_speculative_tokens": int(drafter.gamma)}})
    try:
        res = run(target, drafter, engines, prompts, args.max_new, conc, args.pause, args.repeats)
    finally:
        for e in engines.values():
            e.close()
    report(res, cfg, args, drafter, src, engines, len(prompts))


if __name__ == "__main__":
    main()

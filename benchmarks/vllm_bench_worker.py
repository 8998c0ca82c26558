"""vLLM's side of benchmarks/bench_vllm.py: greedy decoding of token-id prompts in
vLLM's offline `LLM`, plain and with a speculative config, in waves of c
concurrent requests per concurrency level c; tokens/s and tau.

Run with a Python that has vLLM (imports vLLM and the standard library only):

    $DEEPSPEC_VLLM_PYTHON benchmarks/vllm_bench_worker.py request.json answer.json

request.json: {"target": DIR, "prompts": [[ids], ...], "max_tokens": N,
"concurrency": [1, 4, 16], "speculative_config": {...} or null, "enforce_eager": bool,
"kv_cache_gb": G, "max_model_len": L, "threads": T}
answer.json: {"vllm_version", "load_s", "runs": [{"concurrency", "tokens", "time_s",
"tokens_per_s", "drafts", "draft_tokens", "accepted", "tau"}], "outputs": [[ids], ...]}
"""
from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (0 without speculation)."""
    want = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(want.values(), 0)
    for m in llm.get_metrics():
        if m.name in want:
            out[want[m.name]] = int(getattr(m, "value", 0))
    return out


def main(argv) -> int:
    req = json.load(open(argv[0]))
    threads = int(req.get("threads", 2))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gb", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    conc = [int(c) for c in req["concurrency"]]
    t0 = time.perf_counter()
    kw = dict(model=req["target"], dtype="float32", max_model_len=int(req.get("max_model_len", 2048)),
              enforce_eager=bool(req.get("enforce_eager", True)), seed=0, disable_log_stats=False,
              max_num_seqs=max(conc))
    if req.get("speculative_config"):
        kw["speculative_config"] = dict(req["speculative_config"])
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=False, detokenize=False)
    prompts = [{"prompt_token_ids": list(p)} for p in req["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    runs, outputs = [], None
    for c in conc:
        before = _counters(llm)
        toks, t = 0, time.perf_counter()
        outs = []
        for i in range(0, len(prompts), c):  # waves of c concurrent requests
            res = llm.generate(prompts[i : i + c], params, use_tqdm=False)
            outs += [list(r.outputs[0].token_ids) for r in res]
        dt = time.perf_counter() - t
        toks = sum(len(o) for o in outs)
        after = _counters(llm)
        d = {k: after[k] - before[k] for k in after}
        tau = 1 + d["accepted"] / d["drafts"] if d["drafts"] else None
        runs.append({"concurrency": c, "tokens": toks, "time_s": dt, "tokens_per_s": toks / dt, **d, "tau": tau})
        outputs = outputs or outs
        print(f"vllm c={c}: {toks} tokens in {dt:.1f} s, tau {tau}", file=sys.stderr, flush=True)
    json.dump({"vllm_version": vllm.__version__, "load_s": load_s, "runs": runs, "outputs": outputs},
              open(argv[1], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

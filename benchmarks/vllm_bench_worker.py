"""vLLM's side of benchmarks/bench_vllm.py: one vLLM offline `LLM` (plain, or with
a speculative config) that stays loaded and decodes, greedily, each wave of
token-id prompts it is sent, timing it; so that the benchmark can interleave its
waves with ours and with the other vLLM engine's (one at a time, never at once).

Run with a Python that has vLLM (imports vLLM and the standard library only):

    $DEEPSPEC_VLLM_PYTHON benchmarks/vllm_bench_worker.py request.json

request.json: {"target": DIR, "speculative_config": {...} or null, "enforce_eager": bool,
"kv_cache_gb": G, "max_model_len": L, "threads": T, "max_num_seqs": S}.
Protocol, one JSON object per line: the worker first writes {"vllm_version", "load_s"}
on its stdout, then answers each line {"prompts": [[ids], ...], "max_tokens": N} read
from stdin with {"time_s", "outputs": [[ids], ...], "drafts", "draft_tokens", "accepted"}
(the speculative counters of that wave; 0 without speculation), until stdin closes.
Everything vLLM itself prints goes to stderr.
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
    answers = os.fdopen(os.dup(1), "w")  # our protocol; vLLM's own prints go to stderr
    os.dup2(2, 1)
    req = json.load(open(argv[0]))
    threads = int(req.get("threads", 2))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gb", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kw = dict(model=req["target"], dtype="float32", max_model_len=int(req.get("max_model_len", 2048)),
              enforce_eager=bool(req.get("enforce_eager", True)), seed=0, disable_log_stats=False,
              max_num_seqs=int(req.get("max_num_seqs", 16)),
              enable_prefix_caching=False)  # every wave prefills its prompts, as ours does (no reuse across passes)
    if req.get("speculative_config"):
        kw["speculative_config"] = dict(req["speculative_config"])
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    answers.write(json.dumps({"vllm_version": vllm.__version__, "load_s": load_s}) + "\n")
    answers.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(ask["max_tokens"]), ignore_eos=False, detokenize=False)
        before = _counters(llm)
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": list(p)} for p in ask["prompts"]], params, use_tqdm=False)
        dt = time.perf_counter() - t
        after = _counters(llm)
        answers.write(json.dumps({"time_s": dt, "outputs": [list(r.outputs[0].token_ids) for r in res],
                                  **{k: after[k] - before[k] for k in after}}) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

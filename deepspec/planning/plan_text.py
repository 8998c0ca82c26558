"""`plan`'s plain-text table: the plan dict of `deepspec.planning.plan.build_plan`
rendered as the rows `python -m deepspec plan` prints."""
from __future__ import annotations

from ..files import human_bytes


def _n(x: float) -> str:
    """1234567 -> 1.23 M."""
    for unit, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.3g}"


def _h(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.3g}"


def format_plan(plan: dict) -> str:
    """The plan as a plain-text table (what `plan` prints)."""
    t, d, c, tr, ev, hw = (plan[k] for k in ("target", "data", "cache", "training", "evaluation", "hardware"))
    rows = [("target", f"{t['spec']} ({t['model_type']}, {t['num_layers']} layers, d {t['hidden_size']}, "
                       f"V {t['vocab_size']}, {_n(t['params'])} params; facts: {t['facts_from']})"),
            ("data: training prompts", f"{d['train_prompts']:,}"),
            ("data: tokens per sample", f"{d['tokens_per_sample']:,} (prompt {d['prompt_tokens_per_sample']:g}: "
                                        f"{d['prompt_tokens_from']}; answer {d['answer_tokens_per_sample']:g}: {d['answer_tokens_from']})"),
            ("data: regenerated tokens", f"{_n(d['regenerated_tokens'])} (at most {_n(d['regenerated_tokens_upper_bound'])})"),
            ("cache: bytes per token", f"{c['bytes_per_token']:,} = ({c['feature_layers']} feature layers + final hidden) x "
                                       f"{c['hidden_size']} x {c['hidden_bytes_per_token'] // ((c['feature_layers'] + 1) * c['hidden_size'])} B "
                                       f"({c['dtype']}) + 4 B id + 1 B loss mask" + (" + 4 B log-normalizer" if c["target_lse"] else "")),
            ("cache: offline total", f"{human_bytes(c['offline_total_bytes'])} = {_n(c['offline_total_bytes'])}B ({_n(d['tokens'])} tokens); "
                                     f"cache.mode here: {c['mode']}"),
            ("cache: online extra per step", f"target forward {_n(c['online_target_forward_flops_per_step'])}FLOP "
                                             f"(one per micro batch, {_n(tr['target_forward_flops_per_token'])}FLOP per token)")]
    for m, r in tr["methods"].items():
        p, mem, tot = r["params"], r["activation_memory_at_max_length"], tr["totals"][m]
        lay = r["draft_layers"]
        rows += [(f"{m}: parameters", f"trainable {_n(p['trainable'])} ({lay['count']} {lay['model_type']} draft "
                                      f"layer{'s' if lay['count'] != 1 else ''}), frozen {_n(p['frozen_own'])} own + "
                                      f"{_n(p['frozen_shared_target'])} target embedding/head"),
                 (f"{m}: FLOPs per step", f"{_n(r['flops_per_step'])}FLOP measured (fwd+bwd, {r['micro_batches_per_step']} "
                                          f"micro-batches of {_n(r['flops_per_micro_batch'])}FLOP)"),
                 (f"{m}: steps", f"{r['steps_per_epoch']:,} per epoch, {r['total_steps']:,} in total "
                                 f"({r['online_target_forwards']:,} target forwards online)"),
                 (f"{m}: activations/micro-batch", f"{human_bytes(mem['peak_activation_bytes'])} at length {d['max_length']} "
                                                   f"(saved {human_bytes(mem['saved_bytes'])} + largest tensor {human_bytes(mem['largest_tensor_bytes'])})"),
                 (f"{m}: memory per GPU", "{} = target {} + drafter {} + gradients {} + Adam {}{} + activations {} "
                                          "(arithmetic; without online features and allocator slack)".format(
                                              *(human_bytes(r["memory_per_gpu"][k]) for k in ("total", "target_weights",
                                                "drafter_weights", "gradients", "adam_moments")),
                                              f" (sharded / {r['memory_per_gpu']['optimizer_shards']})"
                                              if r["memory_per_gpu"]["optimizer_shards"] > 1 else "",
                                              human_bytes(r["memory_per_gpu"]["activations"]))),
                 (f"{m}: checkpoints on disk", "{} = {} kept x {} (fp32 drafter {} + AdamW moments {}; {} "
                                               "regular, train.keep_checkpoints keeps {}{}); {} while the next is written"
                                               .format(human_bytes(r["checkpoints"]["bytes_kept"]), r["checkpoints"]["kept"],
                                                       *(human_bytes(r["checkpoints"][k]) for k in
                                                         ("bytes_each", "model_bytes", "optimizer_bytes")),
                                                       r["checkpoints"]["regular_checkpoints"], r["checkpoints"]["kept_regular"],
                                                       " + the newest timed one" if r["checkpoints"]["kept_timed"] else "",
                                                       human_bytes(r["checkpoints"]["bytes_peak"]))),
                 (f"{m}: GPU-hours", f"{_h(tot['gpu_hours_offline'])} offline / {_h(tot['gpu_hours_online'])} online "
                                     f"({_h(tot['wall_hours_offline'])} / {_h(tot['wall_hours_online'])} h on {hw['gpus']} GPUs)")]
    if tr["methods"]:
        rows.append(("checkpoints: all methods", f"{human_bytes(sum(r['checkpoints']['bytes_kept'] for r in tr['methods'].values()))} "
                                                 "kept (each method's training keeps its own)"))
    for m, r in ev["methods"].items():
        rows.append((f"eval: {m}", f"{r['rounds']:,} rounds, {_h(r['hours'])} h at {r['rounds_per_s']:.3g} rounds/s "
                                   f"at batch 1 ({ev['tau_from']}; rate from {ev['rates_from']})"))
    em = ev["memory_per_gpu"]
    rows.append(("eval: memory per GPU", "{:.1f} GiB of {:g} ({}) = target {:.1f} + drafter {:.1f} + KV cache {:.1f} ({}; "
                                         "{:,} B per token for the target + {:,} for the drafter's context, {:.2f} GiB per "
                                         "longest row) + reserve {:g} (arithmetic)".format(
                                             em["total"], em["gpu_memory_gib"], "fits" if em["fits"] else "DOES NOT FIT",
                                             em["target_weights"], em["drafter_weights"], em["kv_cache"], em["kv_from"],
                                             em["kv_bytes_per_token"], em["drafter_kv_bytes_per_token"],
                                             em["longest_row_gib"], em["reserve"])))
    pd_ = ev["plain_decoding"]
    timed = ", ".join(f"{n} of {b}" for b, n in pd_["timed_prompts"].items() if n) or "none"
    rows.append(("eval: plain decoding", f"{pd_['forwards']:,} forwards, {_h(pd_['hours'])} h at {pd_['forwards_per_s']:.3g} "
                                         "forwards/s if every prompt were decoded plainly (no job does: evaluate and the "
                                         f"baselines time the first prompts of the timed benchmarks, {timed})"))
    rg = plan["regeneration"]
    if rg["estimated"]:
        rows.append(("regeneration", f"{_h(rg['hours'])} h for the expected answer tokens, {_h(rg['hours_upper_bound'])} h "
                                     f"at the upper bound, at {_n(rg['tokens_per_s'])} tokens/s on {rg['gpus']} GPUs "
                                     f"(plan.regenerate_mfu {hw['regenerate_mfu']:g}); resources.regenerate.runtime "
                                     f"{_h(rg['runtime_hours'])} h" + ("" if rg["within_runtime"] else
                                                                    ": THE UPPER BOUND EXCEEDS IT")))
    else:
        rows.append(("regeneration", f"not estimated: {rg['why']}"))
    width = max(len(k) for k, _ in rows)
    head = (f"plan for preset {plan['preset']}: {hw['gpus']} GPUs x {hw['gpu_tflops']:g} TFLOP/s x MFU {hw['mfu']:g}")
    return "\n".join([head, "-" * len(head)] + [f"{k.ljust(width)}  {v}" for k, v in rows])

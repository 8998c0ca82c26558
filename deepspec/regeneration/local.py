"""Regeneration's local backend: the target itself, in this process, answering
batches of prompts turn by turn (`regenerate.backend: local`)."""
from __future__ import annotations

import contextlib
import time

import torch

from ..data.conversations import with_system_prompt
from ..data.prompts import Prompt
from ..runtime import resolve_precision
from ..settings import Settings
from .sampling import Sampling, generate_batch, record_seed


def regenerate_precision(s: Settings) -> str:
    """The local backend's compute dtype: regenerate.precision resolved on this
    machine (`runtime.resolve_precision`)."""
    return resolve_precision(s.regenerate.precision, s.target.device, stage="regenerate")



def sampling_kernels(target) -> contextlib.AbstractContextManager:
    """The context regeneration samples in: a bf16 target on oneDNN-packed weights
    (`core.target.prepacked_linears`: 2.6-2.8x fp32's tokens/s at batches of 40 on AMX-BF16),
    gradients off; an fp32 one on torch's own kernels (packing it measured no gain, 15.0
    against 15.6 s for 40 prompts x 32 tokens, and would change its rounding, so its samples)."""
    from ..core.target import prepacked_linears

    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.no_grad())
    if target.lm_head.weight.dtype == torch.bfloat16:
        ctx.enter_context(prepacked_linears(target))
    return ctx



def regenerate_local(s: Settings, prompts: list[Prompt], write, too_long, bar, target=None) -> int:
    from ..targets.loading import target_from_config

    regen, system = s.regenerate, s.data.system_prompt
    target = target or target_from_config(s, dtype=regenerate_precision(s))
    tok, limit = target.tokenizer, s.data.max_prompt_tokens
    first = {p.id: len(target.chat_ids(with_system_prompt([{"role": "user", "content": p.turns[0]}], system))) for p in prompts}
    order = sorted(prompts, key=lambda p: (first[p.id], p.id))
    n_tokens, shown = 0, time.perf_counter()

    def on_step(n):  # the bar counts records; show tokens/s while a batch is still running
        nonlocal n_tokens, shown
        n_tokens += n
        if time.perf_counter() - shown > 1.0:
            shown = time.perf_counter()
            bar.set_postfix_str(f"{n_tokens} tok, {n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")

    for b in range(0, len(order), regen.batch_size):
        batch = order[b : b + regen.batch_size]
        convs = {p.id: [] for p in batch}
        failed: dict[str, str] = {}
        for turn in range(max(len(p.turns) for p in batch)):
            rows, ids = [], []
            for p in batch:
                if p.id in failed or turn >= len(p.turns):
                    continue
                convs[p.id].append({"role": "user", "content": p.turns[turn]})
                x = target.chat_ids(with_system_prompt(convs[p.id], system))
                if len(x) > limit:
                    failed[p.id] = f"too long: the history of turn {turn} has {len(x)} tokens, over data.max_prompt_tokens={limit}"
                    continue
                rows.append(p)
                ids.append(x)
            if not rows:
                continue
            gens = [torch.Generator().manual_seed(record_seed(regen.seed, p.id, turn)) for p in rows]
            with sampling_kernels(target):
                outs = generate_batch(target.model, ids, gens, Sampling.of(regen), eos_ids=target.eos_token_ids, pad_id=tok.pad_token_id, on_step=on_step)
            for p, o in zip(rows, outs):
                truncated = not (o and o[-1] in target.eos_token_ids)
                o = [t for t in o if t not in target.eos_token_ids]
                msg = {"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)}
                convs[p.id].append({**msg, "truncated": True} if truncated else msg)
        write([{"id": p.id, "source": p.source, "messages": convs[p.id]} for p in batch if p.id not in failed])
        for p in batch:
            if p.id in failed:
                too_long(p, failed[p.id])
        bar.update(len(batch))
    return n_tokens

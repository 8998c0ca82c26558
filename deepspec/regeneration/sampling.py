"""The local regeneration backend's sampler (the target's own decoding of
training answers): filtered sampling with per-record generators, and batched
generation with a KV cache. `regenerate` (local backend) and `serve` (the
OpenAI-compatible test server) decode with it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..core.target import cache_kwarg
from ..core.verify import sample
from ..settings import Regenerate


@dataclass(frozen=True)
class Sampling:
    """How one generation samples: regenerate's settings (`Sampling.of`), or one
    chat request's (the CPU chat server). top_k 0: no top-k."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int

    @classmethod
    def of(cls, regen: Regenerate) -> "Sampling":
        return cls(regen.temperature, regen.top_p, regen.top_k, regen.min_p, regen.max_new_tokens)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates after temperature, top-k, top-p and min-p (HF order).

    Returns (logits [B, K], token ids [B, K]) sorted by decreasing logit,
    -inf where filtered out; K = top_k (or the vocabulary when top_k == 0), so
    the usual top_k = 20 never sorts the whole vocabulary. With no filter at
    all (top_k 0, top_p 1, min_p 0: plain sampling at the temperature) the
    whole vocabulary comes back in token order, unsorted.
    """
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if not 0 < top_k < V and top_p >= 1.0 and min_p <= 0.0:  # nothing filtered: the vocabulary as it is, unsorted
        return logits, torch.arange(V, device=logits.device).expand_as(logits)
    k = top_k if 0 < top_k < V else V
    logits, ids = torch.topk(logits, k, dim=-1)  # sorted, descending
    if top_p < 1.0:
        p = torch.softmax(logits, dim=-1)
        drop = (p.cumsum(-1) - p) >= top_p  # the mass before this token already reaches top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        p = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(p < min_p * p[..., :1], float("-inf"))
    return logits, ids


def sample_next(logits: torch.Tensor, generators: Sequence[torch.Generator], regen: Sampling) -> torch.Tensor:
    """One token per row, row r drawn with generators[r]; greedy when T == 0."""
    if regen.temperature <= 0:
        return logits.argmax(-1)
    cand, ids = filter_logits(logits, regen.temperature, regen.top_k, regen.top_p, regen.min_p)
    # one float64 uniform per row from that row's generator (core.verify.sample)
    return ids.gather(-1, sample(torch.softmax(cand, dim=-1), list(generators))[:, None])[:, 0]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    generators: Sequence[torch.Generator],
    regen: Sampling,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    on_step: Optional[Callable[[int], None]] = None,
) -> list[list[int]]:
    """Sample continuations of left-padded `prompts` with a KV cache.

    Each row stops at its first EOS (included in the result) or after
    regen.max_new_tokens; finished rows are dropped from the batch (and its
    cache) so they cost nothing more. `on_step(n)` reports n new tokens.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    am = torch.zeros((B, L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p):] = torch.tensor(p)
        am[r, L - len(p):] = 1
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    ids, am, pos = ids.to(device), am.to(device), pos.to(device)
    cache = DynamicCache(config=model.config)
    ckw = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, **{ckw: cache}, use_cache=True, logits_to_keep=1)
    next_pos = pos[:, -1] + 1
    alive = list(range(B))
    gens = list(generators)
    results: list[list[int]] = [[] for _ in range(B)]
    eos = set(int(e) for e in eos_ids)
    for step in range(regen.max_new_tokens):
        toks = sample_next(out.logits[:, -1], gens, regen)
        keep = []
        for j, (r, t) in enumerate(zip(alive, toks.tolist())):
            results[r].append(t)
            if t not in eos:
                keep.append(j)
        if on_step:
            on_step(len(alive))
        if not keep or step == regen.max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            am, next_pos, toks = am[idx], next_pos[idx], toks[idx]
            alive, gens = [alive[j] for j in keep], [gens[j] for j in keep]
        am = torch.cat([am, am.new_ones((len(alive), 1))], dim=1)
        out = model(
            input_ids=toks[:, None].to(device),
            attention_mask=am,
            position_ids=next_pos[:, None],
            **{ckw: cache},
            use_cache=True,
        )
        next_pos = next_pos + 1
    return results


def record_seed(seed: int, record_id: str, turn: int) -> int:
    """A stable 63-bit seed per (run seed, record, turn)."""
    h = hashlib.sha256(f"{seed}\0{record_id}\0{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)

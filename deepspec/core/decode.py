"""The speculative decode loop and its baselines, batch size 1 (paper Sec. 2.1;
DeepSpec's deepspec/eval/base_evaluator.py).

`speculative_generate` drives every drafter through the API of docs/INTERFACES.md,
one `speculative_round` at a time:

    target prefill -> first token -> repeat {drafter proposes a block -> the target
    scores anchor + block in one forward pass -> verify_chain -> keep the accepted
    tokens, crop the target's KV cache to them -> next anchor}
    until max_new_tokens or EOS.

It records one dict per round (columns of the per-round records). `plain_generate`
is autoregressive decoding with the same sampling code and seeds (the tokens/s
baseline); `prompt_lookup_generate` is transformers' drafter-free prompt-lookup
decoding. All three time themselves with time.perf_counter, prefill included.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..errors import DeepSpecError
from .batch_cache import engine_cache, grouped_query_sdpa
from .scheduler import SPSCurve, truncate_by_threshold
from .target import Target, cache_kwarg, crop_cache, lm_head_in_chunks, new_cache, prepacked_linears, select_features
from .verify import (
    cut_at_eos,
    emitted_tokens,
    greedy_decisions,
    is_greedy,
    logits_to_probs,
    rejection_decisions,
    sample,
    verify_chain,
)


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded; a final EOS included)
    time_s: float  # wall time of the whole generation, prefill included
    rounds: list[dict] = field(default_factory=list)  # per-round records (speculative only)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_forward(target: Target, ids: torch.Tensor, cache, layers: Optional[Sequence[int]], last_only: bool = False):
    """One KV-cached target forward: logits [1, n or 1, V] and features [1, n, m*d] (or None).
    The target's linear layers run on weights packed once for the CPU's kernels
    with target.cpu_matmul onednn (`target.prepacked_linears`); else the LM head runs
    in vocabulary chunks where that is faster (`target.lm_head_in_chunks`; the same
    logits bit for bit). Masked attention (a verification forward) groups the query heads
    in torch's sdpa instead of copying K/V per head, as the engine's forward does."""
    with prepacked_linears(target), lm_head_in_chunks(target), grouped_query_sdpa(ids.device.type == "cpu"):
        out = target.model(
            input_ids=ids,
            **{cache_kwarg(target.model): cache},
            use_cache=True,
            output_hidden_states=layers is not None,
            logits_to_keep=1 if last_only else 0,
        )
    return out.logits, (None if layers is None else select_features(out.hidden_states, layers))


@dataclass
class Proposal:
    """A drafter's proposal for one round (docs/INTERFACES.md); per request in the engine."""

    tokens: torch.Tensor  # [1, gamma] long, target-vocab ids
    probs: Optional[torch.Tensor]  # [1, gamma, V] float, the exact (tempered) distributions, full target vocab
    # (None only for the engine's plain decoding rows, which draft nothing)
    conf_logits: Optional[torch.Tensor] = None  # [1, gamma] float, or None without a confidence head


class Verified(NamedTuple):
    """What verification of one request's round decided (`verify_row`)."""

    accepted: int
    tokens: list[int]  # emitted: the accepted drafts, then the correction or bonus (none after an accepted EOS)
    proposal_len: int  # stops at an accepted EOS
    accept_prob: list[float]  # a_k at the reachable positions
    alpha: list[float]  # alpha_k at the same positions


def proposal_length(prop, threshold: float) -> int:
    """Tokens of a proposal to verify: all gamma, cut at the first position with
    sigmoid(conf_logit) < threshold (threshold > 0 and a confidence head)."""
    n = prop.tokens.shape[1]
    if threshold > 0 and prop.conf_logits is not None:
        n = int(truncate_by_threshold(torch.sigmoid(prop.conf_logits[0].float()), threshold))
    return max(0, n)


def _check_proposal(prop, vocab: int) -> None:
    g = prop.tokens.shape[-1]
    if prop.tokens.shape != (1, g) or prop.probs.shape != (1, g, vocab):
        raise DeepSpecError(
            f"drafter/target mismatch: proposal tokens {tuple(prop.tokens.shape)} and probs "
            f"{tuple(prop.probs.shape)}, expected [1, gamma] and [1, gamma, {vocab}] (the target vocabulary)"
        )


@dataclass
class Round:
    """What one speculative round produced (the source of its per-round record)."""

    tokens: list[int]  # emitted: the accepted drafts, then the correction or bonus (none after an accepted EOS)
    accepted: int
    proposal_len: int  # verified draft length; an accepted EOS ends the proposal there
    accept_prob: list[float]  # a_k = min(1, p_t(x_k)/p_d(x_k)) at each reachable verified position
    alpha: list[float]  # alpha_k = sum_v min(p_d, p_t) at the same positions
    conf_logits: Optional[list[float]]  # the drafter's confidence logits (None without a head)
    gamma: int  # the drafter's proposal length
    draft_time_s: float
    verify_time_s: float
    ctx: torch.Tensor  # [1, 1 + accepted]: anchor + accepted drafts, verified but unseen by the drafter
    feats: torch.Tensor  # [1, 1 + accepted, m*d]: their target features
    width: int = 0  # tokens this request put through the target forward: anchor + verified drafts


def speculative_round(target: Target, drafter, state, cache, ctx, feats, anchor, *, feature_layers, temperature,
                      generator, confidence_threshold, policy=None) -> Round:
    """One round of Sec. 2.1: the drafter proposes a block from the context it
    has not seen yet (`ctx`, `feats`) and the anchor; the target scores anchor +
    the first n drafts in one KV-cached forward; chain verification accepts a
    prefix and emits a correction or bonus token; the target's KV cache is cropped
    back to the verified tokens. n: every draft, or cut by the confidence threshold,
    or what `policy` (core/policies.py, e.g. Algorithm 1) picks from the proposal."""
    device = target.device
    t_draft = time.perf_counter()
    # Algorithm 1 (`policies.LiveAlgorithm1`) may end a block with confidences (DSpark) where no
    # verification will reach
    early = {"stop": policy.stop_after} if hasattr(policy, "stop_after") and getattr(
        drafter, "confidence", None) is not None else {}
    with prepacked_linears(target, drafter):  # the drafter's matmuls through the same kernels as the target's
        prop = drafter.propose(state, feats, torch.cat([ctx, anchor], 1), temperature=temperature, generator=generator,
                               **early)
    _check_proposal(prop, target.vocab_size)
    sync_device(device)
    t_verify = time.perf_counter()
    # Full proposals even near the end (as the reference evaluator does), so the
    # last round's acceptance is measured like any other; the caller trims the output.
    n = proposal_length(prop, confidence_threshold) if policy is None else int(policy.lengths([prop])[0])
    draft = prop.tokens[:, :n].to(device)
    n_cached = cache.get_seq_length()
    logits, feats = target_forward(target, torch.cat([anchor, draft], 1), cache, feature_layers)
    v = verify_row(logits, prop.probs[:, :n].to(device), draft, temperature=temperature,
                   eos_token_ids=target.eos_token_ids, generator=generator)
    crop_cache(cache, n_cached + 1 + v.accepted)  # anchor + accepted drafts are now verified
    sync_device(device)
    conf = None if prop.conf_logits is None else prop.conf_logits[0].float().tolist()
    return Round(tokens=v.tokens, accepted=v.accepted, proposal_len=v.proposal_len, accept_prob=v.accept_prob,
                 alpha=v.alpha, conf_logits=conf, gamma=getattr(drafter, "gamma", prop.tokens.shape[1]),
                 draft_time_s=t_verify - t_draft,
                 verify_time_s=time.perf_counter() - t_verify, ctx=torch.cat([anchor, draft[:, :v.accepted]], 1),
                 feats=feats[:, : v.accepted + 1], width=1 + n)


def verify_row(logits, probs, draft, *, temperature, eos_token_ids, generator) -> Verified:
    """Verification of one request's round: logits [1, n+1, V] of anchor + n drafts,
    their draft distributions probs [1, n, V] and tokens draft [1, n]. Chain
    rejection sampling (`verify_chain`) for n > 0, else a plain decoding step.
    Returns a `Verified`."""
    n = draft.shape[1]
    if n == 0:  # nothing to verify: a plain decoding step
        return Verified(0, [int(sample(logits_to_probs(logits[:, 0], temperature), generator))], 0, [], [])
    res = verify_chain(logits, probs, draft, temperature=temperature, eos_token_ids=eos_token_ids, generator=generator)
    accepted, emitted = int(res.accepted[0]), res.tokens[0, : int(res.num_emitted[0])].tolist()
    reach = int(res.reachable[0])  # positions past a drafted EOS cannot be reached
    a_k, alpha_k = res.accept_prob[0, :reach].tolist(), res.alpha[0, :reach].tolist()
    return Verified(accepted, emitted, (accepted if bool(res.eos_stop[0]) else n), a_k, alpha_k)


def verify_rows(logits, probs, draft, lengths: Sequence[int], *, temperature, eos_token_ids, generators, extra=None):
    """`verify_row` for every row of a round at once (core/engine.py): logits
    [R, W, V] of each row's anchor + drafts, probs [R, >= W-1, V] (None when no
    row drafts), draft tokens [R, W-1]; row r verifies its first lengths[r]
    drafts with its own generator, whose draws are those `verify_row` would make
    (the same uniforms in the same order), so the results are the same bit for
    bit. One host transfer for all rows (with `extra` [R, k], e.g. confidence
    logits, riding along). Returns (per-row `Verified`s as `verify_row` returns them, accepted [R] on
    the device, extra's rows as lists or None)."""
    R, g = draft.shape
    dev = draft.device
    n = torch.tensor(list(lengths), device=dev)
    valid = torch.arange(g, device=dev).expand(R, g) < n[:, None]
    drafts = torch.where(valid, draft.long(), torch.full_like(draft, -1, dtype=torch.long))  # -1: never a token
    zero = [r for r, ell in enumerate(lengths) if ell == 0]  # a plain decoding step (verify_row's n == 0)
    some = [r for r, ell in enumerate(lengths) if ell > 0]
    accepted, fill = torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.long, device=dev)
    accept_prob = alpha = torch.zeros(R, g, device=dev)
    eos_stop, reachable = torch.zeros(R, dtype=torch.bool, device=dev), torch.zeros(R, dtype=torch.long, device=dev)
    if some and is_greedy(temperature):
        accepted, fill, accept_prob, alpha = greedy_decisions(logits, drafts)
    elif some:
        u = torch.full((R, g), torch.inf, device=dev)  # inf: past the row's drafts, rejected
        for r in some:
            u[r, : lengths[r]] = torch.rand((lengths[r],), generator=generators[r], device=dev)
        p_d = torch.where(valid[..., None], probs[:, :g].to(dev), 0.0)  # zero past the drafts: the bonus is p_t
        accepted, residual, accept_prob, alpha = rejection_decisions(logits, p_d, draft.long(), temperature, u)
        fill[some] = sample(residual[some], [generators[r] for r in some])
    if some:
        accepted, eos_stop, reachable = cut_at_eos(drafts, accepted, eos_token_ids)
    if zero:  # greedy too: sampled from the one-hot argmax, so the stream advances as verify_row's
        fill[zero] = sample(logits_to_probs(logits[zero, 0], temperature), [generators[r] for r in zero])
    tokens, num_emitted = emitted_tokens(drafts, accepted, fill, eos_stop)
    cols = [accepted[:, None], num_emitted[:, None], eos_stop[:, None], torch.minimum(reachable, n)[:, None], tokens,
            accept_prob, alpha] + ([] if extra is None else [extra.to(dev)])
    host = torch.cat([c.double() for c in cols], 1).tolist()  # exact: token ids < 2**53, fp32 -> fp64
    out, more = [], []
    for r, row in enumerate(host):
        acc, emit, stop, reach = (int(x) for x in row[:4])
        if lengths[r] == 0:
            out.append(Verified(0, [int(row[4])], 0, [], []))
        else:
            a, b = 4 + g + 1, 4 + g + 1 + g
            out.append(Verified(acc, [int(x) for x in row[4 : 4 + emit]], acc if stop else lengths[r],
                                row[a : a + reach], row[b : b + reach]))
        more.append(row[4 + g + 1 + 2 * g :])
    return out, accepted, None if extra is None else more


def round_record(index: int, r: Round) -> dict:
    """The per-round record (docs/INTERFACES.md): NaN confidence logits without a
    head, NaN a_k / alpha_k past the verified (reachable) positions."""
    def padded(xs):
        return list(xs) + [math.nan] * (r.gamma - len(xs))

    return {
        "round": index,
        "proposal_len": r.proposal_len,
        "accepted": r.accepted,
        "emitted": len(r.tokens),
        "draft_time_s": r.draft_time_s,
        "verify_time_s": r.verify_time_s,
        **{f"conf_logit_{k + 1}": c for k, c in enumerate(padded(r.conf_logits or []))},
        **{f"accept_prob_{k + 1}": v for k, v in enumerate(padded(r.accept_prob))},
        **{f"alpha_{k + 1}": v for k, v in enumerate(padded(r.alpha))},
    }


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter,
    prompt_ids: Sequence[int],
    *,
    feature_layers: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
    confidence_threshold: float = 0.0,
    policy=None,
) -> Generation:
    """Speculative decoding of one prompt (chain verification, lossless): prefill,
    first token, then `speculative_round`s until max_new_tokens or EOS; one
    record per round (`round_record`). `policy` (core/policies.py) picks how many
    drafts each round verifies; None: all, or those the confidence threshold keeps."""
    device = target.device
    cache, rounds, out = engine_cache(), [], []  # in place: no copy of the whole cache per forward (batch_cache.py)
    sync_device(device)
    t_start = time.perf_counter()
    state = drafter.init_state()
    ctx = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # verified, unseen by the drafter
    logits, feats = target_forward(target, ctx, cache, feature_layers, last_only=True)
    out.append(int(sample(logits_to_probs(logits[:, -1], temperature), generator)))
    while len(out) < max_new_tokens and out[-1] not in target.eos_token_ids:
        anchor = torch.tensor([[out[-1]]], dtype=torch.long, device=device)
        r = speculative_round(target, drafter, state, cache, ctx, feats, anchor, feature_layers=feature_layers,
                              temperature=temperature, generator=generator, confidence_threshold=confidence_threshold,
                              policy=policy)
        ctx, feats = r.ctx, r.feats
        out.extend(r.tokens[: max_new_tokens - len(out)])
        rounds.append({**round_record(len(rounds), r), "batch_size": 1, "verify_tokens": r.width})
    sync_device(device)
    return Generation(tokens=out, time_s=time.perf_counter() - t_start, rounds=rounds)


@torch.no_grad()
def plain_generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> Generation:
    """Autoregressive decoding with a KV cache and the same sampling code as the loop above."""
    device, eos = target.device, set(target.eos_token_ids)
    cache, out = engine_cache(), []  # in place, as speculative_generate's
    sync_device(device)
    t_start = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    while True:
        logits, _ = target_forward(target, ids, cache, None, last_only=True)
        out.append(int(sample(logits_to_probs(logits[:, -1], temperature), generator)))
        if len(out) >= max_new_tokens or out[-1] in eos:
            break
        ids = torch.tensor([[out[-1]]], dtype=torch.long, device=device)
    sync_device(device)
    return Generation(tokens=out, time_s=time.perf_counter() - t_start)


@torch.no_grad()
def prompt_lookup_generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    num_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> Generation:
    """transformers' prompt-lookup decoding (n-gram drafts from the prompt), pure
    sampling at `temperature` (no top-k/top-p), seeded through the global RNG."""
    device = target.device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    sampling = {} if is_greedy(temperature) else {"temperature": float(temperature), "top_k": 0, "top_p": 1.0}
    torch.manual_seed(seed)
    sync_device(device)
    t_start = time.perf_counter()
    seq = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        prompt_lookup_num_tokens=num_tokens,
        max_new_tokens=max_new_tokens,
        do_sample=not is_greedy(temperature),
        eos_token_id=list(target.eos_token_ids),
        pad_token_id=target.tokenizer.pad_token_id,
        **sampling,
    )
    sync_device(device)
    return Generation(tokens=seq[0, ids.shape[1]:].tolist(), time_s=time.perf_counter() - t_start)


@torch.no_grad()
def profile_target_sps(target: Target, batch_sizes, context_len: int = 256, seed: int = 0, *,
                       feature_layers: Optional[Sequence[int]] = None, repeats: int = 5) -> SPSCurve:
    """SPS(B) of this target on this machine (Algorithm 1's hardware curve for one
    request): target forwards per second over B new tokens after a KV-cached context
    of `context_len` random tokens, each made as a batch-1 round makes it
    (`target_forward`, with the features of `feature_layers`). After one warm-up
    pass the sizes are visited `repeats` times, in alternating order, and each keeps
    its median: a drift of the machine's speed falls on all sizes alike, and one
    slow forward cannot make verifying a second token look dear (Algorithm 1's early
    stop would then verify nothing)."""
    g = torch.Generator().manual_seed(seed)
    dev, sizes = target.device, [int(b) for b in batch_sizes]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cache = new_cache()
    times: dict[int, list[float]] = {b: [] for b in sizes}
    with torch.no_grad():
        target_forward(target, torch.randint(0, target.vocab_size, (1, context_len), generator=g).to(dev), cache,
                       None, last_only=True)
        for rep in range(repeats + 1):
            for b in (sizes if rep % 2 else sizes[::-1]):
                ids = torch.randint(0, target.vocab_size, (1, b), generator=g).to(dev)
                sync()
                t0 = time.perf_counter()
                target_forward(target, ids, cache, feature_layers)
                sync()
                if rep:  # the first pass warms every size up
                    times[b].append(time.perf_counter() - t0)
                crop_cache(cache, context_len)
    return SPSCurve(np.asarray(sizes), np.asarray([1.0 / float(np.median(times[b])) for b in sizes]))

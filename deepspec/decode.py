"""The speculative decode loop and its baselines, batch size 1 (paper Sec. 2.1, notes §2, §4).

`speculative_generate` drives every drafter through the API of docs/INTERFACES.md:

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
from typing import Optional, Sequence

import torch

from .io import DeepSpecError
from .sampling import is_greedy, logits_to_probs, sample, verify_chain
from .schedule import truncate_by_threshold
from .targets import Target, cache_kwarg, select_features


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded; a final EOS included)
    time_s: float  # wall time of the whole generation, prefill included
    rounds: list[dict] = field(default_factory=list)  # per-round records (speculative only)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache. A negative argument
    removes that many tokens in transformers 4.x and 5.x alike (5.x rejects positive ones)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _forward(target: Target, ids: torch.Tensor, cache, layers: Optional[Sequence[int]], last_only: bool = False):
    """One KV-cached target forward: logits [1, n or 1, V] and features [1, n, m*d] (or None)."""
    out = target.model(
        input_ids=ids,
        **{cache_kwarg(target.model): cache},
        use_cache=True,
        output_hidden_states=layers is not None,
        logits_to_keep=1 if last_only else 0,
    )
    return out.logits, (None if layers is None else select_features(out.hidden_states, layers))


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
) -> Generation:
    """Speculative decoding of one prompt (chain verification, lossless).

    Each round records proposal_len (the verified draft length; if an accepted
    draft token is EOS the round ends there and this is the EOS position),
    accepted, emitted (= tau of the round), draft_time_s, verify_time_s,
    conf_logit_1..gamma (NaN without a confidence head), and per draft position
    accept_prob_k = min(1, p_t(x_k)/p_d(x_k)) and alpha_k = sum_v min(p_d, p_t),
    the probabilities verification used (NaN past the verified length or a
    drafted EOS); metrics.position_table turns them into the Rao-Blackwellised
    Figure-2 estimate.
    """
    device, eos = target.device, tuple(target.eos_token_ids)
    vocab = target.vocab_size
    cache, rounds, out = _new_cache(), [], []
    _sync(device)
    t_start = time.perf_counter()
    state = drafter.init_state()
    ctx = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # verified, unseen by the drafter
    logits, feats = _forward(target, ctx, cache, feature_layers, last_only=True)
    out.append(int(sample(logits_to_probs(logits[:, -1], temperature), generator)))

    while len(out) < max_new_tokens and out[-1] not in eos:
        anchor = torch.tensor([[out[-1]]], dtype=torch.long, device=device)
        t_draft = time.perf_counter()
        prop = drafter.propose(state, feats, torch.cat([ctx, anchor], 1), temperature=temperature, generator=generator)
        _check_proposal(prop, vocab)
        _sync(device)
        t_verify = time.perf_counter()
        # Full proposals even near the end (as the reference evaluator does), so
        # the last round's acceptance is measured like any other; the output is
        # trimmed to max_new_tokens below.
        n = proposal_length(prop, confidence_threshold)
        draft = prop.tokens[:, :n].to(device)
        n_cached = cache.get_seq_length()
        logits, feats = _forward(target, torch.cat([anchor, draft], 1), cache, feature_layers)
        if n > 0:
            res = verify_chain(logits, prop.probs[:, :n].to(device), draft, temperature=temperature,
                               eos_token_ids=eos, generator=generator)
            accepted, new = int(res.accepted[0]), res.tokens[0, : int(res.num_emitted[0])].tolist()
            a_k, alpha_k = res.accept_prob[0].tolist(), res.alpha[0].tolist()
            # Past a drafted EOS a position cannot be reached (an accepted EOS ends the round).
            first_eos = next((i for i, t in enumerate(draft[0].tolist()) if t in eos), n)
            a_k, alpha_k = a_k[: first_eos + 1], alpha_k[: first_eos + 1]
        else:  # nothing to verify: a plain decoding step
            accepted, new = 0, [int(sample(logits_to_probs(logits[:, -1], temperature), generator))]
            a_k, alpha_k = [], []
        crop_cache(cache, n_cached + 1 + accepted)  # anchor + accepted drafts are now verified
        feats = feats[:, : accepted + 1]
        ctx = torch.cat([anchor, draft[:, :accepted]], 1)
        out.extend(new[: max_new_tokens - len(out)])
        _sync(device)
        t_end = time.perf_counter()

        gamma = prop.tokens.shape[1]
        conf = prop.conf_logits[0].float().tolist() if prop.conf_logits is not None else [math.nan] * gamma
        a_k += [math.nan] * (gamma - len(a_k))
        alpha_k += [math.nan] * (gamma - len(alpha_k))
        rounds.append({
            "round": len(rounds),
            "proposal_len": accepted if len(new) == accepted else n,  # an accepted EOS ends the proposal
            "accepted": accepted,
            "emitted": len(new),
            "draft_time_s": t_verify - t_draft,
            "verify_time_s": t_end - t_verify,
            **{f"conf_logit_{k + 1}": c for k, c in enumerate(conf)},
            **{f"accept_prob_{k + 1}": v for k, v in enumerate(a_k)},
            **{f"alpha_{k + 1}": v for k, v in enumerate(alpha_k)},
        })
    _sync(device)
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
    cache, out = _new_cache(), []
    _sync(device)
    t_start = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    while True:
        logits, _ = _forward(target, ids, cache, None, last_only=True)
        out.append(int(sample(logits_to_probs(logits[:, -1], temperature), generator)))
        if len(out) >= max_new_tokens or out[-1] in eos:
            break
        ids = torch.tensor([[out[-1]]], dtype=torch.long, device=device)
    _sync(device)
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
    _sync(device)
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
    _sync(device)
    return Generation(tokens=seq[0, ids.shape[1]:].tolist(), time_s=time.perf_counter() - t_start)

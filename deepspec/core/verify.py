"""Verification (paper Sec. 2.1, Eqs. 1 and 8): rejection sampling
of a drafted chain against the target, the acceptance probability of Eq. 8
and the expected accepted length. Pure tensor code, batched over B rows; the
single source of this math for the decode loop, the losses and the metrics.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy (reference convention)
RESIDUAL_EPS = 1e-8  # residual mass at or below this falls back to p_t
DRAFT_PROB_FLOOR = 1e-8  # the reference clamps p_d(x) before dividing


def is_greedy(temperature: float) -> bool:
    return temperature is None or temperature < GREEDY_EPS


_RECORDED: contextvars.ContextVar = contextvars.ContextVar("deepspec_recorded_logits", default=None)


@contextlib.contextmanager
def recording_logits():
    """Within this context every `logits_to_probs` call also appends its logits (a
    float copy) to the list it yields: the logits a drafter's draws came from, greedy
    included (serving/serve_check.py replays a round to tell a near-tie)."""
    rec: list = []
    token = _RECORDED.set(rec)
    try:
        yield rec
    finally:
        _RECORDED.reset(token)


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) in fp32; one-hot argmax when T is (near) zero."""
    logits = logits.float()
    rec = _RECORDED.get()
    if rec is not None:
        rec.append(logits.detach().clone())
    if is_greedy(temperature):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: Optional[Union[torch.Generator, Sequence[torch.Generator]]] = None
           ) -> torch.Tensor:
    """Draw one index per distribution from probs [..., V] (unnormalised is fine);
    returns [...] long. Inverse-CDF sampling: one float64 uniform u per
    distribution, the first index whose cumulative mass exceeds u * total
    (zero-mass indices are never drawn). torch.multinomial draws V exponentials
    per distribution instead: 1 ms per 49k-vocabulary row here, a fifth of a
    batched drafter call (measured). A list of generators gives probs [B, ..., V]
    one stream per row b, consumed as that row alone would consume it."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    if isinstance(generator, (list, tuple)):
        per = flat.shape[0] // len(generator)
        u = torch.cat([_uniform(per, g, flat.device) for g in generator])
    else:
        u = _uniform(flat.shape[0], generator, flat.device)
    cdf = flat.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    last = V - 1 - (flat > 0).flip(-1).int().argmax(-1)  # u * total can round up to total
    return torch.minimum(idx, last).reshape(probs.shape[:-1])


def draw(probs: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Draft indices from probs [R, ..., K]: argmax when greedy; otherwise sampled
    with `generator`, or row r with generator[r] when it is a list (per-request
    streams: a row consumes its stream as it would at batch size 1)."""
    if is_greedy(temperature):
        return probs.argmax(-1)
    return sample(probs, generator)


def _uniform(n: int, generator: Optional[torch.Generator], device) -> torch.Tensor:
    """n float64 U(0, 1) draws, made on the generator's own device (a CPU generator
    may serve CUDA probabilities, as in regeneration) and moved to `device`."""
    on = device if generator is None else generator.device
    return torch.rand(n, generator=generator, dtype=torch.float64, device=on).to(device)


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] number of draft tokens accepted
    tokens: torch.Tensor  # [B, gamma+1] accepted prefix then correction/bonus, -1 padded
    num_emitted: torch.Tensor  # [B]
    # Per position k, the probability of accepting draft token k given 1..k-1
    # were accepted: a_k = min(1, p_t(x_k)/p_d(x_k)) for the realised token, and
    # its expectation over x_k ~ p_d, alpha_k = sum_v min(p_d, p_t) (Eq. 8).
    # Greedy: both are 1{x_k = argmax p_t}. Used by the Rao-Blackwellised
    # Figure-2 estimator (core.acceptance.position_table); [B, gamma] each.
    accept_prob: Optional[torch.Tensor] = None
    alpha: Optional[torch.Tensor] = None
    # An accepted EOS ended the round (no correction or bonus); and the draft
    # positions verification can reach at all: up to and including the first
    # drafted EOS (accepted or not), [B] each.
    eos_stop: Optional[torch.Tensor] = None
    reachable: Optional[torch.Tensor] = None


def _first_true(mask: torch.Tensor, default: int) -> torch.Tensor:
    """Index of the first True along the last dim, or `default` where none."""
    n = mask.shape[-1]
    idx = torch.arange(n, device=mask.device).expand_as(mask)
    return torch.where(mask, idx, torch.full_like(idx, default)).min(-1).values


def verify_chain(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    eos_token_ids: Iterable[int] = (),
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    target_logits [B, g+1, V] predict draft tokens 1..g and the bonus;
    draft_probs [B, g, V] are the exact (tempered) distributions the draft
    tokens [B, g] were sampled from. Token k is accepted with probability
    min(1, p_t(x_k) / p_d(x_k)); the first rejection emits a token from
    norm(max(0, p_t - p_d)); if all g are accepted a bonus comes from p_t at
    g+1. An accepted EOS ends the round without a bonus. T < 1e-5 is greedy.
    """
    B, g = draft_tokens.shape
    if target_logits.shape[:2] != (B, g + 1):
        raise ValueError(f"target_logits must be [B, gamma+1, V] = [{B}, {g + 1}, V], got {tuple(target_logits.shape)}")
    draft_tokens = draft_tokens.long()
    if is_greedy(temperature):
        accepted, fill, accept_prob, alpha = greedy_decisions(target_logits, draft_tokens)
    else:
        if draft_probs.shape[:2] != (B, g):
            raise ValueError(f"draft_probs must be [B, gamma, V] = [{B}, {g}, V], got {tuple(draft_probs.shape)}")
        accepted, fill, accept_prob, alpha = _rejection_sampling(target_logits, draft_probs, draft_tokens,
                                                                 temperature, generator)
    accepted, eos_stop, reachable = cut_at_eos(draft_tokens, accepted, eos_token_ids)
    tokens, num_emitted = emitted_tokens(draft_tokens, accepted, fill, eos_stop)
    return VerifyResult(accepted=accepted, tokens=tokens, num_emitted=num_emitted, accept_prob=accept_prob, alpha=alpha,
                        eos_stop=eos_stop, reachable=reachable)


def emitted_tokens(draft_tokens, accepted, fill, eos_stop):
    """The accepted prefix of each row's drafts, then its correction or bonus `fill`
    (none after an accepted EOS): (tokens [B, g+1], -1 padded; num_emitted [B])."""
    B, g = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    tokens = torch.full((B, g + 1), -1, dtype=torch.long, device=draft_tokens.device)
    keep = torch.arange(g, device=draft_tokens.device).expand(B, g) < accepted.unsqueeze(-1)
    tokens[:, :g] = torch.where(keep, draft_tokens, tokens[:, :g])
    put = ~eos_stop
    tokens[rows[put], accepted[put]] = fill[put]
    return tokens, accepted + put.long()


def greedy_decisions(target_logits, draft_tokens):
    """T = 0: a draft token is accepted iff it is the target's argmax; the
    correction (or the bonus after g accepted) is the argmax there."""
    g = draft_tokens.shape[1]
    greedy = target_logits.argmax(-1)  # [B, g+1]
    ok = draft_tokens == greedy[:, :g]
    accepted = _first_true(~ok, g)
    fill = greedy[torch.arange(len(greedy), device=greedy.device), accepted]
    return accepted, fill, ok.float(), ok.float()


def _rejection_sampling(target_logits, draft_probs, draft_tokens, temperature, generator):
    """Accept token k w.p. min(1, p_t(x_k)/p_d(x_k)); at the first rejection
    sample from norm(max(0, p_t - p_d)). Returns (accepted [B], correction or
    bonus token [B], a_k [B, g], alpha_k [B, g])."""
    u = torch.rand(draft_tokens.shape, generator=generator, device=draft_tokens.device)
    accepted, residual, accept_prob, alpha = rejection_decisions(target_logits, draft_probs, draft_tokens, temperature, u)
    return accepted, sample(residual, generator), accept_prob, alpha


def rejection_decisions(target_logits, draft_probs, draft_tokens, temperature, u):
    """`_rejection_sampling` given its uniforms u [B, g] (float32): (accepted [B],
    the distribution of the correction or bonus token [B, V], a_k [B, g], alpha_k [B, g]).
    u = inf at a position rejects it whatever the ratio (ragged rows, core/engine.py)."""
    B, g = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    p_t = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, g+1, V]
    p_d = draft_probs.float()
    pt_x = p_t[:, :g].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    pd_x = p_d.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).clamp_min(DRAFT_PROB_FLOOR)
    ok = u < pt_x / pd_x  # min(1, ratio) is implicit: u < 1 always
    accepted = _first_true(~ok, g)
    # Residual at the first rejected position; at position g+1 p_d is zero,
    # so the same expression yields p_t itself (the bonus distribution).
    p_d_pad = torch.cat([p_d, torch.zeros_like(p_d[:, :1])], dim=1)
    residual = (p_t[rows, accepted] - p_d_pad[rows, accepted]).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(RESIDUAL_EPS), p_t[rows, accepted])
    return accepted, residual, (pt_x / pd_x).clamp(max=1.0), acceptance_rate(p_d, p_t[:, :g])


def cut_at_eos(draft_tokens, accepted, eos_token_ids):
    """An accepted EOS ends the round: no correction or bonus after it.
    Returns (accepted, eos_stop [B] bool, reachable [B]: positions up to and
    including the first drafted EOS)."""
    B, g = draft_tokens.shape
    device = draft_tokens.device
    eos = list(eos_token_ids)
    if not eos:
        return accepted, torch.zeros(B, dtype=torch.bool, device=device), torch.full((B,), g, device=device)
    is_eos = torch.isin(draft_tokens, torch.tensor(eos, device=device))
    pos = torch.arange(g, device=device).expand(B, g)
    first_eos = _first_true(is_eos & (pos < accepted.unsqueeze(-1)), g)
    eos_stop = first_eos < g
    accepted = torch.where(eos_stop, first_eos + 1, accepted)
    return accepted, eos_stop, (_first_true(is_eos, g) + 1).clamp(max=g)


def acceptance_rate(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """Probability that a token drawn from p_d is accepted against p_t (Eq. 8):
    sum_v min(p_d, p_t) = 1 - 0.5 * ||p_d - p_t||_1, over the last dim."""
    return torch.minimum(p_d, p_t).sum(-1)


def expected_tau(c: torch.Tensor) -> torch.Tensor:
    """E[tau] = 1 + sum_k prod_{i<=k} c_i over the last dim (bonus included)."""
    return 1.0 + torch.cumprod(c, dim=-1).sum(-1)

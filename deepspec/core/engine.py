"""Batched speculative decoding over R concurrent requests (paper Sec. 2.1 and
3.2.2): the engine that Algorithm 1 schedules.

Each round, for the R active requests:

    one batched drafter call (`drafter.propose_batch`, or `propose` per row for
    drafters without it) -> the verification policy picks l_r draft tokens per
    request (core/policies.py: fixed gamma, static threshold, live Algorithm 1)
    -> one batched target forward over anchor + l_r drafts of every request ->
    `verify_rows` (chain rejection sampling of every row at once, each with that
    request's own generator, one host transfer) -> each row keeps only its
    verified tokens.

Requests are independent: each has its own prompt length, its own
torch.Generator seeded from the request (its draft and verification draws come
from that stream in the order they would at batch size 1), and its own drafter
state. Finished requests (EOS or max_new_tokens) leave and queued ones join
(continuous batching): a joining request is prefilled alone and takes the row
of one that left in place (`BatchKV.put_many`); with no request queued the batch
shrinks (`BatchKV.remove`: the last rows move into the free ones, one row copied
per leaving request).

Ragged lengths are handled by padding, in the batch cache of
core/batch_cache.py (`BatchKV`: every row keeps only its verified tokens).

With a KV budget (`kv_budget_bytes`), a queued request joins only while every
row, padded to the longest request among them (`batch_cache.row_slots` of
prompt + max_new_tokens), fits in the budget at the target's KV bytes per
position (measured on the first prefill's cache): long requests run at fewer
rows than short ones. One request alone always runs.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..errors import DeepSpecError
from .batch_cache import BatchKV, cache_bytes_per_token, engine_cache, has_sliding_window, row_slots
from .decode import Proposal, Round, round_record, sync_device, target_forward, verify_rows
from .policies import FixedGamma
from .scheduler import SPSCurve, profile_sps
from .target import Target, prepacked_linears
from .verify import logits_to_probs, sample


@dataclass
class Request:
    request_id: object
    prompt_ids: Sequence[int]
    max_new_tokens: int
    seed: int = 0  # the request's own sampling stream


@dataclass
class Finished:
    request: Request
    tokens: list[int]  # new tokens (a final EOS included)
    rounds: list[dict]  # per-round records + batch_size (R) and verify_tokens (this request's 1 + l_r)
    time_s: float  # from joining (prefill) to leaving


@dataclass
class _Row:
    request: Request
    generator: torch.Generator
    state: object  # the drafter's per-request state
    out: list
    ctx: Optional[torch.Tensor]  # [1, n] verified tokens the drafter has not seen
    feats: Optional[torch.Tensor]  # [1, n, m*d] their target features
    t_join: float
    rounds: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.request.max_new_tokens


def check_prompt(target: Target, req: Request) -> None:
    """A request the target can decode: a non-empty prompt of token ids in its
    vocabulary that fits its context (max_position_embeddings); one
    DeepSpecError line naming the request otherwise."""
    n, ctx, V = len(req.prompt_ids), target.context_length, target.vocab_size
    if n == 0:
        raise DeepSpecError(f"request {req.request_id!r}: empty prompt (no token ids to decode from)")
    if ctx is not None and n > ctx:
        raise DeepSpecError(f"request {req.request_id!r}: prompt of {n} tokens is longer than the context of "
                            f"{target.target_id!r} ({ctx} tokens)")
    bad = next((t for t in req.prompt_ids if not 0 <= int(t) < V), None)
    if bad is not None:
        raise DeepSpecError(f"request {req.request_id!r}: token id {bad} outside the target vocabulary (0..{V - 1})")


class BatchedEngine:
    """Speculative decoding of many requests at once (module docstring). `drafter`
    None runs plain batched decoding (one target token per request per forward)."""

    def __init__(self, target: Target, drafter, *, feature_layers: Sequence[int], temperature: float = 1.0,
                 policy=None, max_batch: int = 8, kv_budget_bytes: Optional[float] = None):
        self.target, self.drafter, self.temperature = target, drafter, temperature
        self.layers = None if drafter is None else list(feature_layers)
        self.policy = policy or FixedGamma()
        self.max_batch = int(max_batch)
        self.kv_budget = kv_budget_bytes
        # the KV bytes per position, at the first prefill: the target's cache and the drafter's context K/V
        self.kv_per_token: Optional[float] = None
        self.width = 1 + int(getattr(drafter, "gamma", 0) or 0)  # the most tokens a row verifies per round
        self.eos = set(target.eos_token_ids)
        self.stats = {"rounds": 0, "verify_tokens": 0, "forward_tokens": 0, "max_rows": 0}

    def row_bytes(self, req: Request) -> Optional[float]:
        """The most KV bytes (the target's and the drafter's) one row of the batch takes
        for `req` (None before the first prefill)."""
        if self.kv_per_token is None:
            return None
        return row_slots(len(req.prompt_ids) + req.max_new_tokens, self.width) * self.kv_per_token

    def fits(self, active: Sequence[Request], req: Request) -> bool:
        """Whether `req` may join the rows of `active` within the KV budget: all of them padded to the longest."""
        if self.kv_budget is None or not active or self.kv_per_token is None:
            return True
        return (len(active) + 1) * max(self.row_bytes(r) for r in (*active, req)) <= self.kv_budget

    @torch.no_grad()
    def generate(self, requests: Iterable[Request], on_finish: Optional[Callable[[Finished], None]] = None):
        """Decode every request; continuous batching over at most max_batch rows.
        Returns the Finished requests in the order they finished."""
        queue, rows, kv, done = deque(requests), [], BatchKV(contiguous=has_sliding_window(self.target)), []
        for req in queue:  # every request before any is decoded
            check_prompt(self.target, req)

        def finish(row):
            f = Finished(row.request, row.out, row.rounds, time.perf_counter() - row.t_join)
            done.append(f)
            if on_finish:
                on_finish(f)

        def join(active):
            """The next queued request that does not finish at its prefill and fits beside
            the rows of `active` (the KV budget): (row, cache) or None."""
            while queue and self.fits(active, queue[0]):
                row, cache = self._join(queue.popleft())
                if not self._finished(row):
                    return row, cache
                finish(row)
            return None

        while queue or rows:
            joining = []
            while len(rows) < self.max_batch and (new := join([r.request for r in rows])):
                rows.append(new[0])
                joining.append((new[1], len(new[0].request.prompt_ids)))
            if joining:
                kv.add_many(joining)
            if not rows:
                continue
            self._round(rows, kv)
            leaving = [i for i, r in enumerate(rows) if self._finished(r)]
            for i in leaving:
                finish(rows[i])
            # queued requests take the rows of those that left, in place (no copy of the batch)
            placing = []
            while leaving and (new := join([r.request for i, r in enumerate(rows) if i not in leaving])):
                i = leaving.pop(0)
                rows[i] = new[0]
                placing.append((i, new[1], len(new[0].request.prompt_ids)))
            if placing:
                kv.put_many(placing)
            if leaving:  # nothing queued: the batch shrinks
                rows[:] = [rows[i] for i in kv.remove(leaving)]
        return done

    def _finished(self, row: _Row) -> bool:
        return row.done or row.out[-1] in self.eos

    def _join(self, req: Request):
        """Prefill the prompt alone, sample the first token from the request's stream.
        Returns the row and its prompt's KV cache."""
        sync_device(self.target.device)
        t0 = time.perf_counter()
        dev = self.target.device
        gen = torch.Generator(device=dev).manual_seed(int(req.seed))
        ids = torch.tensor([list(req.prompt_ids)], dtype=torch.long, device=dev)
        cache = engine_cache()
        logits, feats = target_forward(self.target, ids, cache, self.layers, last_only=True)
        if self.kv_per_token is None:
            # the drafter's context K/V (a drafter without any, e.g. a test's, has no kv_bytes_per_token)
            drafter = getattr(self.drafter, "kv_bytes_per_token", lambda: 0)()
            self.kv_per_token = cache_bytes_per_token(cache, ids.shape[1]) + drafter
        first = int(sample(logits_to_probs(logits[:, -1], self.temperature), gen))
        state = None if self.drafter is None else self.drafter.init_state()
        return _Row(req, gen, state, [first], ids, feats, t0), cache

    def _propose(self, rows) -> list:
        """One batched drafter call; a `Proposal` per row (tokens [1,g], probs [1,g,V], conf [1,g] | None)."""
        d, T = self.drafter, self.temperature
        anchors = [torch.tensor([[r.out[-1]]], device=r.ctx.device) for r in rows]
        tokens = [torch.cat([r.ctx, a], 1) for r, a in zip(rows, anchors)]
        if hasattr(d, "propose_batch"):
            p = d.propose_batch([r.state for r in rows], [r.feats for r in rows], tokens, temperature=T,
                                generator=[r.generator for r in rows])
            conf = [None] * len(rows) if p.conf_logits is None else p.conf_logits.split(1)
            return [Proposal(t, q, c) for t, q, c in zip(p.tokens.split(1), p.probs.split(1), conf)]
        # per-row fallback: drafters without a batched propose
        return [d.propose(r.state, r.feats, t, temperature=T, generator=r.generator) for r, t in zip(rows, tokens)]

    def _round(self, rows, kv: BatchKV) -> None:
        dev, R = self.target.device, len(rows)
        sync_device(dev)
        t0 = time.perf_counter()
        if self.drafter is None:
            props = [Proposal(torch.zeros(1, 0, dtype=torch.long), None)] * R
        else:
            with prepacked_linears(self.target, self.drafter):  # the drafter's matmuls as the target's
                props = self._propose(rows)
        ells = [0] * R if self.drafter is None else [int(x) for x in self.policy.lengths(props)]
        sync_device(dev)
        t1 = time.perf_counter()
        W = 1 + max(ells)
        ids = torch.tensor([[r.out[-1]] * W for r in rows], dtype=torch.long, device=dev)
        for i, (p, ell) in enumerate(zip(props, ells)):
            ids[i, 1 : 1 + ell] = p.tokens[0, :ell].to(dev)
        widths = torch.tensor([1 + ell for ell in ells], device=dev)
        start = kv.length
        logits, feats = kv.forward(self.target, ids, widths, self.layers)
        # every row at once, each with its own generator, one host transfer (decode.verify_rows)
        probs = None if W == 1 or props[0].probs is None else torch.cat([p.probs[:, : W - 1].to(dev) for p in props])
        confs = None if any(p.conf_logits is None for p in props) else torch.cat([p.conf_logits.float() for p in props])
        results, accepted, conf_rows = verify_rows(logits[:, :W], probs, ids[:, 1:W], ells,
                                                   temperature=self.temperature, eos_token_ids=self.target.eos_token_ids,
                                                   generators=[r.generator for r in rows], extra=confs)
        kv.commit(start, 1 + accepted)
        sync_device(dev)
        t2 = time.perf_counter()
        B = R + sum(ells)  # sum of the rows' 1 + l_r (no device sync)
        self.stats["rounds"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], R)
        self.stats["verify_tokens"] += B
        self.stats["forward_tokens"] += R * W
        for i, (row, p, v) in enumerate(zip(rows, props, results)):
            conf = None if p.conf_logits is None else (conf_rows[i] if conf_rows is not None
                                                       else p.conf_logits[0].float().tolist())
            rnd = Round(tokens=v.tokens, accepted=v.accepted, proposal_len=v.proposal_len, accept_prob=v.accept_prob,
                        alpha=v.alpha, conf_logits=conf, gamma=p.tokens.shape[1], draft_time_s=t1 - t0,
                        verify_time_s=t2 - t1, ctx=ids[i : i + 1, : 1 + v.accepted],
                        feats=None if feats is None else feats[i : i + 1, : 1 + v.accepted], width=1 + ells[i])
            row.rounds.append({**round_record(len(row.rounds), rnd), "batch_size": R, "verify_tokens": rnd.width})
            row.ctx, row.feats = rnd.ctx, rnd.feats
            row.out.extend(v.tokens[: row.request.max_new_tokens - len(row.out)])


@torch.no_grad()
def profile_engine_sps(target: Target, rows: int, widths: Sequence[int], context_len: int = 256,
                       seed: int = 0) -> SPSCurve:
    """SPS(B) of the engine's own verification forward on this machine: `rows`
    requests with `context_len` verified tokens each, every row verifying w tokens
    (B = rows * w, w in `widths`), through `BatchKV` exactly as a round runs it."""
    g = torch.Generator().manual_seed(seed)
    dev = target.device
    kv = BatchKV(contiguous=has_sliding_window(target))
    joining = []
    for _ in range(rows):
        cache = engine_cache()
        ids = torch.randint(0, target.vocab_size, (1, context_len), generator=g).to(dev)
        target_forward(target, ids, cache, None, last_only=True)
        joining.append((cache, context_len))
    kv.add_many(joining)
    by_tokens = {rows * int(w): int(w) for w in widths}

    def forward(B):
        w = by_tokens[B]
        ids = torch.randint(0, target.vocab_size, (rows, w), generator=g).to(dev)
        kv.forward(target, ids, torch.full((rows,), w, device=dev), None)
        kv.commit(context_len, torch.zeros(rows, dtype=torch.long, device=dev))

    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    return profile_sps(forward, sorted(by_tokens), sync=sync)


def padding_share(stats: dict) -> float:
    """Share of the engine's forward tokens that were padding (ragged verify lengths)."""
    return 1.0 - stats["verify_tokens"] / stats["forward_tokens"] if stats["forward_tokens"] else math.nan

"""One training step per drafter family: how a batch of cached target states
becomes the per-position tensors of the losses (`deepspec.core.losses`).

Block drafters (DFlash, DSpark; `block_step`): up to `num_anchors` anchors
per sequence, uniform without replacement (the step's generator), among
positions p with loss_mask[p] and loss_mask[p+1] (the anchor and its first
target are assistant tokens); block position j of anchor p predicts token
p+1+j, which the target predicted from its final hidden state at p+j; block
targets past the sequence or outside the loss mask are masked, and validity
is a contiguous prefix of each block (`block_targets`).

Chain drafter (Eagle3; `chain_step`): row t of TTT step s predicts token
t+2+s, which the target predicted at t+1+s; the rows that count and each
step's normaliser are `losses.chain_row_mask` / `losses.chain_normalizer`
(DeepSeek's rules by default: loss mask at t+s, t+s < length-1, divided by B*T).
With `chain_rows` (train.chain_rows) steps s > 0 run only on that many rows per
sequence, drawn uniformly among those with a loss at some step s > 0 and weighted
by the inverse of their sequence's sampling fraction, so each step's loss is an
unbiased estimate of the all-rows loss at a fraction of its attention and head cost.

p_t (the frozen full-vocabulary head on the cached final hidden states)
dominates the cost of a small drafter, so it is computed once per distinct
sequence position and gathered by the blocks / steps that read it, as long as
that table fits in `pt_table_bytes`; beyond, each chunk computes its own rows.
With a reduced draft vocabulary and the target's log-normalizers in the batch
(``target_lse``, stored by the cache), a row of p_t costs the K draft columns
of the LM head instead of all V (`DrafterBase.draft_vocab_target_probs`).
The head terms run in chunks of `chunk_positions` positions under activation
checkpointing, so no [positions, V] tensor outlives its chunk; a chain step
whose TTT steps' rows all fit in one chunk keeps their graphs instead (the same
memory, no recomputation in the backward). DFlash's loss is
CE only: there p_t serves only the logged c* and is skipped off log steps.
`vocab_peak_bytes` bounds the vocabulary-sized memory of a step (table + one chunk).

The drafter says what its loss needs: `drafter.distills` (L1 and confidence
terms, DSpark) and `drafter.confidence_logits`; each drafter class binds its
step as `training_step`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from .losses import (
    LossWeights,
    block_loss,
    chain_loss,
    chain_normalizer,
    chain_row_mask,
    position_weights,
    soft_ce_terms,
    token_terms,
)
from .verify import expected_tau

# fp32 [chunk_positions, V] tensors one head chunk holds at once in its forward
# and backward (logits, log-probabilities, p_d, |p_d - p_t|, c*, the gradients;
# measured 5-6 at V = 151,936 by tests/test_efficient_training.py).
CHUNK_VOCAB_TENSORS = 8


@dataclass(frozen=True)
class StepSpec:
    """Everything a training step needs besides the batch."""

    num_anchors: int = 512  # anchors per sequence (block drafters)
    chain_rows: int = 0  # Eagle3: rows per sequence whose TTT chain runs past step 0 (0: every row)
    coef: LossWeights = field(default_factory=LossWeights)
    chunk_positions: int = 512  # positions per checkpointed head chunk
    pt_table_bytes: int = 1 << 30  # the shared p_t table is built when it fits in this


def vocab_peak_bytes(spec: "StepSpec", vocab_size: int, table_rows=None) -> int:
    """Upper bound on the vocabulary-sized bytes a training step (forward and
    backward, either family) holds at once, whatever the batch: the p_t table,
    table_rows x V fp32 when that fits in spec.pt_table_bytes (None: the largest
    table allowed; block steps: distinct positions read, chain steps: B x L), plus
    one head chunk's working set, CHUNK_VOCAB_TENSORS x chunk_positions x V fp32.
    Never a [anchors x gamma, V] or [B x L, V] tensor beyond that (`plan` reports
    this bound). Gradients of vocabulary-sized parameters (DSpark's Markov W1 and
    W2) are parameter memory and not included."""
    table = spec.pt_table_bytes if table_rows is None else int(table_rows) * vocab_size * 4
    if table > spec.pt_table_bytes:
        table = 0  # over budget: each chunk computes its own p_t rows
    return table + CHUNK_VOCAB_TENSORS * spec.chunk_positions * vocab_size * 4


def sample_anchors(loss_mask, attention_mask, num_anchors: int, generator=None):
    """Up to `num_anchors` anchors per sequence, uniformly without replacement.

    A position p is eligible when the anchor token and its first target are both
    assistant tokens: loss_mask[p] and loss_mask[p+1] (and both unpadded); so
    every sampled block has at least one valid target. Returns anchors [B, N]
    (sorted; padding anchors are 0) and valid [B, N] with N = min(num_anchors,
    max eligible count in the batch).
    """
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    elig = torch.zeros_like(lm)
    elig[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return sample_rows(elig, num_anchors, generator)


def sample_rows(eligible, num: int, generator=None):
    """Up to `num` of the eligible positions [B, L] per sequence, uniformly
    without replacement. Returns positions [B, N] (sorted; padding entries are
    0) and valid [B, N] with N = min(num, the most eligible in one sequence)."""
    counts = eligible.sum(1)
    N = int(min(num, counts.max().item() if counts.numel() else 0))
    if N == 0:
        z = torch.zeros(eligible.shape[0], 0, dtype=torch.long, device=eligible.device)
        return z, z.bool()
    u = torch.rand(eligible.shape, generator=generator, device="cpu" if generator is None else generator.device)
    u = u.to(eligible.device).masked_fill(~eligible, -1.0)
    idx = u.topk(N, dim=1).indices
    valid = eligible.gather(1, idx)
    idx = torch.where(valid, idx, torch.full_like(idx, eligible.shape[1]))  # invalid last after sorting
    idx, order = idx.sort(1)
    valid = valid.gather(1, order)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def block_targets(input_ids, loss_mask, attention_mask, anchors, anchor_valid, gamma: int):
    """Targets of each block: position j (0-based) of the block anchored at p
    predicts token p+1+j, which the target predicted from its final hidden state
    at p+j. Valid while p+1+j is inside the sequence and the assistant span;
    validity is made a contiguous prefix. Returns labels [B,N,g], valid [B,N,g],
    src [B,N,g] (= p+j, clamped), prev [B,N,g] (teacher-forced x_{k-1}: anchor, then labels)."""
    B, L = input_ids.shape
    j = torch.arange(gamma, device=input_ids.device)
    tpos = anchors.unsqueeze(-1) + 1 + j  # [B,N,g]
    inside = tpos < L
    tc = tpos.clamp(max=L - 1)
    lm = loss_mask.bool() if attention_mask is None else loss_mask.bool() & attention_mask.bool()
    flat = lambda x: x.reshape(B, -1)  # noqa: E731
    labels = input_ids.gather(1, flat(tc)).view_as(tpos)
    ok = inside & lm.gather(1, flat(tc)).view_as(tpos) & anchor_valid.unsqueeze(-1)
    ok = torch.cumprod(ok.long(), -1).bool()
    anchor_tok = input_ids.gather(1, anchors)
    prev = torch.cat([anchor_tok.unsqueeze(-1), labels[..., :-1]], -1)
    return labels, ok, (tpos - 1).clamp(max=L - 1), prev


def _chunked(fn, rows_per_chunk, *tensors, alone: bool = True):
    """Apply fn over leading-dim chunks, checkpointed when gradients flow. A single
    chunk is kept as is (no recomputation) when it is `alone` in the step; the
    chain step's TTT steps are not (each would keep its [rows, V] graph)."""
    n = tensors[0].shape[0]
    outs = []
    several = n > rows_per_chunk or not alone
    for i in range(0, n, max(1, rows_per_chunk)):
        args = [t[i : i + rows_per_chunk] for t in tensors]
        if several and torch.is_grad_enabled() and any(a.requires_grad for a in args if a.is_floating_point()):
            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return [torch.cat(x) for x in zip(*outs)]


def _zero_loss(drafter):
    return sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)


def _gather_rows(x, idx):
    """x [B, L, d], idx [B, ...] -> [B, ..., d]."""
    B = x.shape[0]
    flat = idx.reshape(B, -1)
    out = x.gather(1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return out.view(*idx.shape, x.shape[-1])


def _cstar_metrics(metrics, cs: list) -> None:
    for k, c in enumerate(cs):
        metrics[f"c_star_{k + 1}"] = c
    metrics["tau_expected"] = float(expected_tau(torch.tensor(cs)))


def _restricted_pt(drafter, last_hidden, chunk: int, lse=None):
    """p_t on the draft vocabulary and the mass outside it, for rows [N, d] (with
    their log-normalizers lse [N] when the cache has them), in chunks written into
    one preallocated table (never the chunks and the table at once)."""
    pt = out = None
    for i, x in zip(range(0, last_hidden.shape[0], chunk), last_hidden.split(chunk)):
        p, m = drafter.draft_vocab_target_probs(x, None if lse is None else lse[i : i + len(x)])
        if pt is None:
            pt = p.new_empty(last_hidden.shape[0], p.shape[-1])
            out = None if m is None else m.new_empty(last_hidden.shape[0])
        pt[i : i + len(x)] = p
        if out is not None:
            out[i : i + len(x)] = m
    return pt, out


@torch.no_grad()
def block_target_probs(drafter, last_hidden, src, keep, spec: StepSpec, lse=None):
    """p_t (draft vocabulary) and the mass outside it, once per distinct
    (sequence, position) read by the block slots src[keep] (src: [B, N, g]
    sequence positions, keep: [B, N] valid anchors; lse [B, L]: the target's
    log-normalizers, or None to compute them from all V logits). Returns (pt [U, K],
    out_mass [U] or None, idx [M, g]) with row idx[m, j] for slot (m, j); or
    None when the U x K table would exceed spec.pt_table_bytes."""
    B, L = last_hidden.shape[:2]
    rows = (torch.arange(B, device=src.device).view(B, 1, 1) * L + src)[keep]  # [M, g] flat row ids
    uniq, idx = torch.unique(rows, return_inverse=True)
    if uniq.numel() * drafter.draft_vocab_size * 4 > spec.pt_table_bytes:
        return None
    pt, out_mass = _restricted_pt(drafter, last_hidden.reshape(B * L, -1)[uniq], spec.chunk_positions,
                                  None if lse is None else lse.reshape(B * L)[uniq])
    return pt, out_mass, idx


def _block_terms(drafter, h, prev, labels, last, lse, src, keep, need_pt: bool, spec: StepSpec):
    """(ce, l1, c*, in-vocab) [M, g] of the valid blocks (h, prev, labels: the
    rows of keep), computed in checkpointed chunks."""
    table = block_target_probs(drafter, last, src, keep, spec, lse) if need_pt else None
    # per slot: a row of the p_t table, or (too large a table) the final hidden state itself
    # (and its log-normalizer when the cache has them)
    extra = [] if not need_pt else [table[2]] if table is not None else [_gather_rows(last, src)[keep]]
    if need_pt and table is None and lse is not None:
        extra.append(lse.gather(1, src.reshape(src.shape[0], -1)).view_as(src)[keep])

    def terms(h_, prev_, labels_, *src_):
        logp = torch.log_softmax(drafter.block_logits(h_, prev_).float(), -1)
        lab = drafter.to_draft_ids(labels_)
        if not src_:
            return token_terms(logp, lab)
        if table is None:
            return token_terms(logp, lab, *drafter.draft_vocab_target_probs(*src_))
        pt, out_mass, _ = table
        return token_terms(logp, lab, pt[src_[0]], None if out_mass is None else out_mass[src_[0]])

    return _chunked(terms, max(1, spec.chunk_positions // drafter.gamma), h, prev, labels, *extra)


def block_step(drafter, batch, spec: StepSpec, generator=None, log_step=True):
    """DFlash / DSpark: one forward + loss (no backward) -> (loss, metrics)."""
    dev = drafter.device
    ids, lm = batch["input_ids"].to(dev), batch["loss_mask"].to(dev)
    am = batch.get("attention_mask")
    am = None if am is None else am.to(dev)
    g = drafter.gamma
    anchors, avalid = sample_anchors(lm, am, spec.num_anchors, generator)
    metrics = {"n_anchors": float(avalid.sum())}
    if not avalid.any():
        _cstar_metrics(metrics, [0.0] * g)
        return _zero_loss(drafter), {**metrics, "loss": 0.0}
    h = drafter(ids, batch["features"].to(dev), anchors, am)  # [B,N,g,d]
    labels, valid, src, prev = block_targets(ids, lm, am, anchors, avalid, g)
    # p_t feeds DSpark's L1 term and its confidence targets; DFlash's loss is CE only
    need_pt = drafter.distills or log_step
    h, labels, valid, prev = (x[avalid] for x in (h, labels, valid, prev))  # [M, g, ...]
    lse = batch.get("target_lse")
    ce, l1, cstar, inv = _block_terms(drafter, h, prev, labels, batch["last_hidden"].to(dev),
                                      None if lse is None else lse.to(dev), src, avalid, need_pt, spec)
    conf = drafter.confidence_logits(h, prev) if drafter.distills else None
    w = position_weights(g, spec.coef.decay_gamma, device=h.device)
    loss, parts = block_loss(ce, l1, cstar, inv, conf, valid, w, spec.coef, distill=drafter.distills)
    metrics.update(parts)
    metrics["loss"] = float(loss.detach())
    if need_pt:
        _cstar_metrics(metrics, [float(cstar[..., k][valid[..., k]].mean()) if valid[..., k].any() else 0.0
                                 for k in range(g)])
    return loss, metrics


@torch.no_grad()
def _chain_target_table(drafter, last, src, valids, spec: StepSpec, lse=None):
    """p_t on the draft vocabulary once per distinct position some TTT step reads
    (src[s][valids[s]], flat ids b*L + position): (table [U, K], row of each flat
    id [B*L], -1 where none), or None when the table exceeds spec.pt_table_bytes.
    Every TTT step reads p_t at the same positions shifted by one, so the
    full-vocabulary head runs once per position, not per step (and not again in
    the checkpointed backward); positions no step reads (the prompt's) not at all."""
    B, L = last.shape[:2]
    base = torch.arange(B, device=last.device).view(B, 1) * L
    flat = torch.cat([(base + sr)[v] for sr, v in zip(src, valids)])
    uniq = torch.unique(flat)
    if uniq.numel() * drafter.draft_vocab_size * 4 > spec.pt_table_bytes:
        return None
    row = torch.full((B * L,), -1, dtype=torch.long, device=last.device)
    row[uniq] = torch.arange(uniq.numel(), device=last.device)
    rows = _restricted_pt(drafter, last.reshape(B * L, -1)[uniq], spec.chunk_positions,
                          None if lse is None else lse.reshape(B * L)[uniq])
    return rows[0], row


def _chain_rows(valids: list, n: int, generator):
    """Steps > 0 on a uniform sample of n rows per sequence among those with a loss
    there, each weighted by the inverse of its sequence's sampling fraction, so every
    step's loss is an unbiased estimate of the all-rows loss (`StepSpec.chain_rows`).
    Returns (rows [B, R] or None for every row, each step's valid rows, each step's
    row weights or None)."""
    S = len(valids)
    if not n or S < 2:
        return None, valids, [None] * S
    elig = torch.stack(valids[1:]).any(0)
    rows, kept = sample_rows(elig, n, generator)
    w = (elig.sum(1) / kept.sum(1).clamp_min(1)).view(-1, 1).expand_as(rows)
    return rows, valids[:1] + [v.gather(1, rows) & kept for v in valids[1:]], [None] + [w] * (S - 1)


def chain_step(drafter, batch, spec: StepSpec, generator=None, log_step=True):
    """Eagle3 (TTT): one forward + loss (no backward) -> (loss, metrics)."""
    dev = drafter.device
    ids, lm = batch["input_ids"].to(dev), batch["loss_mask"].to(dev).bool()
    am = batch.get("attention_mask")
    B, L = ids.shape
    lengths = torch.full((B,), L, device=dev) if am is None else am.to(dev).long().sum(1)
    if am is not None:
        lm = lm & am.to(dev).bool()
    last = batch["last_hidden"].to(dev)
    lse = batch.get("target_lse")
    lse = None if lse is None else lse.to(dev)
    S = drafter.gamma
    valids = [chain_row_mask(lm, lengths, s, spec.coef.eagle3_row_mask) for s in range(S)]
    norms = [chain_normalizer(v, spec.coef.eagle3_normalizer) for v in valids]  # the all-rows pass's
    t = torch.arange(L, device=dev).expand(B, L)
    rows, valids, weights = _chain_rows(valids, spec.chain_rows, generator)
    outs = drafter(ids, batch["features"].to(dev), am if am is None else am.to(dev), rows=rows)
    # row t's target at step s: p_t at t+1+s
    srcs = [((t if rows is None or s == 0 else rows) + 1 + s).clamp(max=L - 1) for s in range(S)]
    table = _chain_target_table(drafter, last, srcs, valids, spec, lse)
    # per row: its row of the p_t table (read inside the chunk: no [rows, K] copy
    # per step outlives its chunk), or (too large a table) the final hidden state
    # (with its log-normalizer as one more column when the cache has them)
    x = table[1].view(B, L, 1) if table is not None else last if lse is None else torch.cat([last, lse[..., None]], -1)
    # the steps' heads keep their graphs (no recomputation in the backward) when all
    # their rows together fit in one chunk, the memory one checkpointed chunk takes
    alone = sum(int(v.sum()) for v in valids) <= spec.chunk_positions

    def terms(h_, x_):
        logp = torch.log_softmax(drafter.draft_logits(h_).float(), -1)
        if table is not None:
            pt = table[0][x_.squeeze(-1)]
        elif lse is None:
            pt = drafter.draft_vocab_target_probs(x_)[0]
        else:
            pt = drafter.draft_vocab_target_probs(x_[..., :-1], x_[..., -1])[0]
        return soft_ce_terms(logp, pt)

    metrics, cs, step_losses, n_pos = {}, [], [], 0
    for s, (h, valid, src, w, norm) in enumerate(zip(outs, valids, srcs, weights, norms)):
        if not valid.any():
            metrics[f"loss_step_{s + 1}"] = 0.0
            cs.append(0.0)
            step_losses.append(None)
            continue
        sce, cstar = _chunked(terms, spec.chunk_positions, h[valid], _gather_rows(x, src)[valid], alone=alone)
        if w is None:
            step_losses.append(sce.sum() / norm)
            cs.append(float(cstar.mean()))
        else:
            w = w[valid].to(sce.dtype)
            step_losses.append((sce * w).sum() / norm)
            cs.append(float((cstar * w).sum() / w.sum()))
        metrics[f"loss_step_{s + 1}"] = float(step_losses[-1].detach())
        n_pos += int(valid.sum())
    loss = _zero_loss(drafter) + chain_loss(step_losses, spec.coef.eagle3_step_decay)
    _cstar_metrics(metrics, cs)
    metrics.update(loss_ce=float(loss.detach()), loss=float(loss.detach()), n_positions=float(n_pos))
    return loss, metrics

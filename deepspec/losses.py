"""Training losses and one training step per drafter (paper Eqs. 8-12; notes §2).

DSpark (Eq. 12):  L = 0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(c_k, c*_k)
  * p_d: the Markov-corrected draft distribution at T = 1 (teacher forced);
  * p_t: softmax of the frozen target LM head on the cached final-norm hidden
    state at the position that predicts the same token (block position j of
    anchor p predicts token p+1+j; the target predicted it at p+j);
  * L1 is the full ||p_d - p_t||_1 (not halved);
  * c*_k = sum_v min(p_d, p_t) (Eq. 8, `sampling.acceptance_rate`), detached.
  Every term is a weighted mean over valid positions, sum(w*l)/sum(w), with
  w_k = exp(-(k-1)/decay), decay = cfg.loss.decay_gamma = 4.0 (the reference
  value; the paper writes the block size, notes §0.5). The paper's Eqs. 9-11
  are written as sums; the reference code (followed here) normalises by sum(w).
DFlash: the same weighted CE, nothing else (reference ce alpha 1.0).
Eagle3: soft-label CE against the full target distribution at each of the
  ttt_length chained steps, step weight 0.8^s, each step a mean over its valid
  positions.
Reduced draft vocabulary: p_d is zero outside the draft vocab, so
  ||p_d - p_t||_1 = sum_in |p_d - p_t| + (target mass outside); c* is unchanged
  by the zeros; CE skips labels outside the draft vocab and Eagle3's soft CE
  ignores the (unreachable) target mass outside it.

Anchors (DFlash/DSpark): up to cfg.train.num_anchors per sequence, uniform
without replacement (the step's `generator`), among positions p with
loss_mask[p] and loss_mask[p+1] (the anchor and its first target are assistant
tokens); block targets past the sequence or outside the loss mask are masked,
and validity is a contiguous prefix of each block (`common.block_targets`).

Memory: the frozen full-vocabulary head dominates, so the head terms are
computed in chunks of CHUNK_POSITIONS positions under activation checkpointing
(no [positions, V] tensor outlives its chunk).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .drafters.common import block_targets, sample_anchors
from .sampling import acceptance_rate, expected_tau, position_weights

CHUNK_POSITIONS = 512


def _restrict(drafter, pt):
    """Target probabilities on the draft vocabulary, plus the mass outside it."""
    if not drafter.reduced_vocab:
        return pt, None
    pin = pt.index_select(-1, drafter.d2t.to(pt.device))
    return pin, (1.0 - pin.sum(-1)).clamp_min(0.0)


def block_head_terms(drafter, h, prev, labels, pt, out_mass):
    """Per-position terms for blocks [m, g]: CE, L1, c* (detached), label-in-vocab.
    pt / out_mass: p_t on the draft vocabulary and the mass outside it (None
    when the vocabularies coincide); pt None skips L1 and c* (returned as zeros)."""
    logp = torch.log_softmax(drafter.block_logits(h, prev).float(), -1)
    lab = drafter.to_draft_ids(labels)
    in_vocab = lab >= 0
    ce = -logp.gather(-1, lab.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    if pt is None:
        return ce, torch.zeros_like(ce), torch.zeros_like(ce), in_vocab.float()
    pd = logp.exp()
    l1 = (pd - pt).abs().sum(-1)
    if out_mass is not None:
        l1 = l1 + out_mass
    return ce, l1, acceptance_rate(pd.detach(), pt), in_vocab.float()


@torch.no_grad()
def block_target_probs(drafter, last_hidden, src, keep):
    """p_t (draft vocabulary) and the mass outside it, once per distinct
    (sequence, position) read by the block slots src[keep] (src: [B, N, g]
    sequence positions, keep: [B, N] valid anchors).

    Overlapping blocks read the same positions, and the frozen full-vocabulary
    head is the dominant cost on a small drafter. Returns (pt [U, K], out_mass
    [U] or None, idx [M, g]) with row idx[m, j] for slot (m, j); or None when the
    U x K table would exceed PRECOMPUTE_PT_BYTES (long sequences with a large
    vocabulary): then each chunk computes its own rows."""
    B, L = last_hidden.shape[:2]
    rows = (torch.arange(B, device=src.device).view(B, 1, 1) * L + src)[keep]  # [M, g] flat row ids
    uniq, idx = torch.unique(rows, return_inverse=True)
    K = drafter.d2t.numel() if drafter.reduced_vocab else drafter.vocab_size
    if uniq.numel() * K * 4 > PRECOMPUTE_PT_BYTES:
        return None
    parts = [_restrict(drafter, drafter.target_probs(x)) for x in last_hidden.reshape(B * L, -1)[uniq].split(CHUNK_POSITIONS)]
    out_mass = None if parts[0][1] is None else torch.cat([m for _, m in parts])
    return torch.cat([p for p, _ in parts]), out_mass, idx


def soft_ce_terms(drafter, h, target_hidden):
    """Eagle3 per-position soft-label CE against p_t, and c* (detached)."""
    return soft_ce_from_probs(drafter, h, _restrict(drafter, drafter.target_probs(target_hidden))[0])


def soft_ce_from_probs(drafter, h, pt):
    """The same with p_t (on the draft vocabulary) already computed."""
    logp = torch.log_softmax(drafter.draft_logits(h).float(), -1)
    return -(pt * logp).sum(-1), acceptance_rate(logp.exp().detach(), pt)


PRECOMPUTE_PT_BYTES = 1 << 30  # Eagle3: compute p_t once per position when it fits in this much memory


def _chunked(fn, rows_per_chunk, *tensors):
    """Apply fn over leading-dim chunks, checkpointed when gradients flow."""
    n = tensors[0].shape[0]
    outs = []
    several = n > rows_per_chunk  # a single chunk is kept as is (no recomputation)
    for i in range(0, n, max(1, rows_per_chunk)):
        args = [t[i : i + rows_per_chunk] for t in tensors]
        if several and torch.is_grad_enabled() and any(a.requires_grad for a in args if a.is_floating_point()):
            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return [torch.cat(x) for x in zip(*outs)]


def weighted_mean(x, w):
    return (w * x).sum() / w.sum().clamp_min(1e-12)


def _zero_loss(drafter):
    return sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)


def _cstar_metrics(metrics, cstar, valid, gamma):
    cs = []
    for k in range(gamma):
        v = valid[..., k]
        c = float(cstar[..., k][v].mean()) if v.any() else 0.0
        metrics[f"c_star_{k + 1}"] = c
        cs.append(c)
    metrics["tau_expected"] = float(expected_tau(torch.tensor(cs)))


def _gather_rows(x, idx):
    """x [B, L, d], idx [B, ...] -> [B, ..., d]."""
    B = x.shape[0]
    flat = idx.reshape(B, -1)
    out = x.gather(1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return out.view(*idx.shape, x.shape[-1])


def block_step(drafter, batch, cfg, generator=None, log_step=True):
    ids, lm = batch["input_ids"], batch["loss_mask"]
    am = batch.get("attention_mask")
    dev = drafter.fc.weight.device
    ids, lm = ids.to(dev), lm.to(dev)
    am = None if am is None else am.to(dev)
    g = drafter.gamma
    anchors, avalid = sample_anchors(lm, am, cfg["train"]["num_anchors"], generator)
    metrics = {"n_anchors": float(avalid.sum())}
    if not avalid.any():
        _cstar_metrics(metrics, torch.zeros(0, g), torch.zeros(0, g, dtype=torch.bool), g)
        return _zero_loss(drafter), {**metrics, "loss": 0.0}
    h = drafter(ids, batch["features"].to(dev), anchors, am)  # [B,N,g,d]
    labels, valid, src, prev = block_targets(ids, lm, am, anchors, avalid, g)
    # p_t feeds DSpark's L1 term and the c* targets of its confidence head; DFlash's
    # loss is CE only, so there p_t is needed for the logged c* metrics alone.
    need_pt = drafter.method != "dflash" or log_step
    last = batch["last_hidden"].to(dev)
    table = block_target_probs(drafter, last, src, avalid) if need_pt else None
    # per slot: a row of the p_t table, or (too large a table) the final hidden state itself
    extra = [] if not need_pt else [table[2]] if table is not None else [_gather_rows(last, src)[avalid]]
    h, labels, valid, prev = (x[avalid] for x in (h, labels, valid, prev))  # [M, g, ...]
    chunk = max(1, CHUNK_POSITIONS // g)

    def terms(h_, prev_, labels_, *src_):
        if not src_:
            return block_head_terms(drafter, h_, prev_, labels_, None, None)
        if table is None:
            return block_head_terms(drafter, h_, prev_, labels_, *_restrict(drafter, drafter.target_probs(src_[0])))
        pt, out_mass, _ = table
        return block_head_terms(drafter, h_, prev_, labels_, pt[src_[0]], None if out_mass is None else out_mass[src_[0]])

    ce, l1, cstar, inv = _chunked(terms, chunk, h, prev, labels, *extra)
    w = position_weights(g, cfg["loss"]["decay_gamma"], device=h.device)
    W = w * valid.float()
    loss_ce = weighted_mean(ce, W * inv)
    metrics["loss_ce"] = float(loss_ce.detach())
    if drafter.method == "dflash":
        loss = loss_ce
    else:
        L = cfg["loss"]
        loss_l1 = weighted_mean(l1, W)
        loss = L["ce_alpha"] * loss_ce + L["l1_alpha"] * loss_l1
        metrics["loss_l1"] = float(loss_l1.detach())
        conf = drafter.confidence_logits(h, prev)
        if conf is not None:
            bce = F.binary_cross_entropy_with_logits(conf.float(), cstar.detach(), reduction="none")
            loss_conf = weighted_mean(bce, W)
            loss = loss + L["conf_alpha"] * loss_conf
            metrics["loss_conf"] = float(loss_conf.detach())
    metrics["loss"] = float(loss.detach())
    if need_pt:
        _cstar_metrics(metrics, cstar, valid, g)
    return loss, metrics


def eagle3_step(drafter, batch, cfg, generator=None):
    dev = drafter.fc.weight.device
    ids, lm = batch["input_ids"].to(dev), batch["loss_mask"].to(dev).bool()
    am = batch.get("attention_mask")
    if am is not None:
        lm = lm & am.to(dev).bool()
    B, L = ids.shape
    last = batch["last_hidden"].to(dev)
    outs = drafter(ids, batch["features"].to(dev), am if am is None else am.to(dev))
    t = torch.arange(L, device=dev)
    decay = cfg["loss"]["eagle3_step_decay"]
    loss = _zero_loss(drafter)
    metrics, cs = {}, []
    n_pos = 0
    # Every TTT step reads p_t at the same positions shifted by one, so when it
    # fits, the full-vocabulary target head runs once per position, not per step
    # (and not again in the checkpointed backward).
    K = drafter.d2t.numel() if drafter.reduced_vocab else drafter.vocab_size
    pt_all = None
    if B * L * K * 4 <= PRECOMPUTE_PT_BYTES:
        with torch.no_grad():
            pt_all = torch.cat([_restrict(drafter, drafter.target_probs(x))[0]
                                for x in last.reshape(B * L, -1).split(CHUNK_POSITIONS)]).view(B, L, K)
    for s, h in enumerate(outs):
        tgt = t + 2 + s  # row t of step s predicts token t+2+s ...
        valid = (tgt < L).expand(B, L) & lm.gather(1, tgt.clamp(max=L - 1).expand(B, L))
        src = (t + 1 + s).clamp(max=L - 1).expand(B, L)  # ... which the target predicted at t+1+s
        if not valid.any():
            metrics[f"loss_step_{s + 1}"] = 0.0
            cs.append(0.0)
            continue
        if pt_all is not None:
            sce, cstar = _chunked(lambda a, b: soft_ce_from_probs(drafter, a, b), CHUNK_POSITIONS,
                                  h[valid], _gather_rows(pt_all, src)[valid])
        else:
            sce, cstar = _chunked(lambda a, b: soft_ce_terms(drafter, a, b), CHUNK_POSITIONS,
                                  h[valid], _gather_rows(last, src)[valid])
        # Mean over this step's valid rows. The reference divides each step by the
        # local B*T instead (padding included); the mean keeps steps with fewer
        # valid rows (later TTT steps, short answers) from being down-weighted
        # beyond the paper's 0.8^step.
        step_loss = sce.mean()
        loss = loss + decay**s * step_loss
        metrics[f"loss_step_{s + 1}"] = float(step_loss.detach())
        cs.append(float(cstar.mean()))
        n_pos += int(valid.sum())
    for k, c in enumerate(cs):
        metrics[f"c_star_{k + 1}"] = c
    metrics["tau_expected"] = float(expected_tau(torch.tensor(cs)))
    metrics["loss_ce"] = float(loss.detach())
    metrics["loss"] = float(loss.detach())
    metrics["n_positions"] = float(n_pos)
    return loss, metrics


def training_step(drafter, batch, cfg, generator=None, log_step=True):
    """One forward + loss (no backward). Returns (scalar loss, float metrics):
    per-term losses, c_star_1..c_star_gamma (mean analytic acceptance per
    position, Eq. 8), tau_expected, and n_anchors (block drafters).
    log_step=False lets DFlash skip the c* metrics (and with them the target
    head); the loss is the same either way."""
    if drafter.method == "eagle3":
        return eagle3_step(drafter, batch, cfg, generator)
    return block_step(drafter, batch, cfg, generator, log_step=log_step)

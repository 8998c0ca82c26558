"""The training losses, as pure functions of tensors (paper Eqs. 8-12).

DSpark (Eq. 12):  L = a_ce L_ce + a_tv L_tv + a_conf L_conf, a = (0.1, 0.9, 1.0)
  * L_ce (Eq. 9)   = weighted mean of -log p_d^k(x*_k);
  * L_tv (Eq. 10)  = weighted mean of ||p_d^k - p_t^k||_1 (the full L1, not halved);
  * L_conf (Eq. 11) = weighted mean of BCE(c_k, c*_k) with the soft label
    c*_k = sum_v min(p_d, p_t) (Eq. 8, `verify.acceptance_rate`), detached;
  p_d is the Markov-corrected draft distribution at T = 1 (teacher forced), p_t
  the frozen target head's distribution at the position that predicts the same
  token. "Weighted mean" is sum(w*l)/sum(w) over valid positions with
  w_k = exp(-(k-1)/decay), decay = 4.0: the paper writes the sums of Eqs. 9-11
  and the block size as the decay, the reference code (followed here, DeepSpec's
  deepspec/modeling/dspark/loss.py) normalises by sum(w) and uses loss_decay_gamma = 4.0.
DFlash: the same weighted CE alone (the reference's ce alpha 1.0, others 0).
Eagle3: soft-label CE against p_t at each of the ttt_length chained steps,
  step weight 0.8^s (`chain_loss`); which rows count at step s
  (`chain_row_mask`) and what each step's sum is divided by (`chain_normalizer`)
  follow DeepSeek's eagle3/loss.py by default.

Reduced draft vocabulary: p_d is zero outside the draft vocabulary, so
||p_d - p_t||_1 = sum_in |p_d - p_t| + (target mass outside) (`out_mass`); c*
is unchanged by the zeros; CE skips labels outside the draft vocabulary (label
-1) and Eagle3's soft CE ignores the (unreachable) target mass outside it.

How the per-position tensors are produced for a batch (anchors, teacher
forcing, the p_t table, chunking) is `deepspec.core.train_step`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .verify import acceptance_rate


@dataclass(frozen=True)
class LossWeights:
    """The coefficients the paper fixes (Eq. 12, its w_k, Eagle3's step decay)."""

    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    decay_gamma: float = 4.0
    eagle3_step_decay: float = 0.8
    # Eagle3's rows and normaliser (`chain_row_mask`, `chain_normalizer`); the
    # defaults are the reference's, the alternatives are documented there.
    eagle3_row_mask: str = "reference"
    eagle3_normalizer: str = "batch_tokens"


def position_weights(gamma: int, decay: float = 4.0, device=None) -> torch.Tensor:
    """Loss weights w_k = exp(-(k-1)/decay), k = 1..gamma.

    The paper writes exp(-(k-1)/gamma) with gamma overloaded as the block size;
    the reference configs use loss_decay_gamma = 4.0 (DeepSpec's config/dspark/*.py), which we follow.
    """
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w * x).sum() / w.sum().clamp_min(1e-12)


def token_terms(logp: torch.Tensor, labels: torch.Tensor, pt: Optional[torch.Tensor] = None,
                out_mass: Optional[torch.Tensor] = None):
    """Per-position terms from draft log-probabilities logp [..., K] (draft
    vocabulary) and labels [...] (draft indices, -1 outside the vocabulary):
    CE (Eq. 9's summand; 0-weighted later where the label is outside), and
    with p_t [..., K] (and the target mass outside the draft vocabulary,
    out_mass [...], or None) the L1 distance (Eq. 10) and c* (Eq. 8,
    detached). Without p_t, L1 and c* are zeros. Returns (ce, l1, c*,
    label-in-vocabulary as float)."""
    in_vocab = labels >= 0
    ce = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    if pt is None:
        return ce, torch.zeros_like(ce), torch.zeros_like(ce), in_vocab.float()
    pd = logp.exp()
    l1 = (pd - pt).abs().sum(-1)
    if out_mass is not None:
        l1 = l1 + out_mass
    return ce, l1, acceptance_rate(pd.detach(), pt), in_vocab.float()


def block_loss(ce, l1, cstar, in_vocab, conf_logits: Optional[torch.Tensor], valid, weights: torch.Tensor,
               coef: LossWeights, distill: bool = True):
    """Eq. 12 over blocks: per-position terms [M, g] (`token_terms`), the
    confidence logits [M, g] (None without a confidence head), valid [M, g]
    and the position weights w [g]. distill=False is the DFlash loss (the
    weighted CE alone). Returns (loss, {term: float})."""
    W = weights * valid.float()
    loss_ce = weighted_mean(ce, W * in_vocab)
    parts = {"loss_ce": float(loss_ce.detach())}
    if not distill:
        return loss_ce, parts
    loss_l1 = weighted_mean(l1, W)
    loss = coef.ce_alpha * loss_ce + coef.l1_alpha * loss_l1
    parts["loss_l1"] = float(loss_l1.detach())
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), cstar.detach(), reduction="none")
        loss_conf = weighted_mean(bce, W)
        loss = loss + coef.conf_alpha * loss_conf
        parts["loss_conf"] = float(loss_conf.detach())
    return loss, parts


def soft_ce_terms(logp: torch.Tensor, pt: torch.Tensor):
    """Eagle3 per position: soft-label CE -sum_v p_t log p_d and c* (detached)."""
    return -(pt * logp).sum(-1), acceptance_rate(logp.exp().detach(), pt)


def chain_loss(step_losses: Sequence[Optional[torch.Tensor]], decay: float = 0.8):
    """Eagle3's TTT loss: sum_s decay^s * L_s over the chained steps s = 0, 1, ...
    (a step without valid rows is None and contributes nothing)."""
    loss = 0.0
    for s, step_loss in enumerate(step_losses):
        if step_loss is not None:
            loss = loss + decay**s * step_loss
    return loss


CHAIN_ROW_MASKS = ("reference", "predicted")
CHAIN_NORMALIZERS = ("batch_tokens", "valid_rows")


def chain_row_mask(loss_mask: torch.Tensor, lengths: torch.Tensor, step: int, rule: str = "reference"):
    """Rows [B, L] of TTT step `step` that enter the Eagle3 loss (row t predicts
    token t+2+step, whose target distribution is p_t at t+1+step).

    "reference" (DeepSeek's eagle3/loss.py, the default): the loss mask at t+step,
    and t+step < length-1 (the last token has no next-token target), i.e. the
    step-0 row mask shifted left by `step`.
    "predicted": the loss mask of the predicted token t+2+step (inside the
    sequence). The reference's rule is two tokens off the predicted token: it
    trains on the two tokens after each assistant span and skips its first two;
    "predicted" trains exactly on the assistant tokens. loss_mask [B, L] bool
    (padding already False), lengths [B] the unpadded lengths."""
    B, L = loss_mask.shape
    t = torch.arange(L, device=loss_mask.device)
    if rule == "predicted":
        tgt = t + 2 + step
        return (tgt < L).expand(B, L) & loss_mask.gather(1, tgt.clamp(max=L - 1).expand(B, L))
    if rule != "reference":
        raise ValueError(f"unknown Eagle3 row mask {rule!r}: use one of {CHAIN_ROW_MASKS}")
    src = t + step
    ok = (src < L).expand(B, L) & loss_mask.gather(1, src.clamp(max=L - 1).expand(B, L))
    return ok & (src.view(1, L) < (lengths.view(B, 1) - 1))


def chain_normalizer(valid: torch.Tensor, rule: str = "batch_tokens") -> float:
    """What one TTT step's summed soft CE is divided by. "batch_tokens" (the
    reference's `local_mean`, the default): B*T of the (padded) batch, whatever
    the number of valid rows, so later steps and short answers weigh less;
    "valid_rows": the step's number of valid rows (a per-step mean)."""
    if rule == "batch_tokens":
        return float(valid.numel())
    if rule == "valid_rows":
        return float(valid.sum().clamp_min(1))
    raise ValueError(f"unknown Eagle3 normaliser {rule!r}: use one of {CHAIN_NORMALIZERS}")

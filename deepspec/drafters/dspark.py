"""DSpark: the DFlash block backbone plus a sequential head (paper Sec. 3.1-3.2,
Eqs. 4-8).

* Markov head (Eq. 5): B(x_{k-1}, .) = W1[x_{k-1}] W2, rank r
  (cfg.drafter.markov_rank, paper 256), added to the base logits U_k *before*
  softmax and before temperature: p_k = softmax((U_k + B_k) / T). For position 1
  the previous token is the anchor x_0. W1 is indexed by target-vocab ids
  (the previous token may be the anchor, outside a reduced draft vocab); W2
  maps to the draft vocabulary.
* RNN head (Eq. 6, cfg.drafter.markov_head_type = rnn): z_k = [s_{k-1};
  W1[x_{k-1}]; h_k], one joint Linear(2r+d -> 3r) gives W_g z, W_c z, W_o z;
  s_k = sig(W_g z) * s_{k-1} + (1 - sig(W_g z)) * tanh(W_c z), s_0 = 0;
  B_k = W2^T tanh(W_o z) (B_k uses z, i.e. s_{k-1}, as written in Eq. 6).
* Confidence head (Eq. 7): c_k = sig(w^T [h_k; W1[x_{k-1}]] + b), Linear(d+r -> 1)
  sharing W1 (confidence_with_markov; Linear(d -> 1) without it). It predicts
  the conditional acceptance of position k; at inference x_{k-1} is the sampled
  draft token.
Training is teacher-forced (x_{k-1} = ground truth); inference samples x_1..x_g
one at a time from the block's hidden states without another backbone pass.
markov_rank 0 and no confidence head reduce this model exactly to DFlash.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..core import verify
from .dflash import DFlashDrafter


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str = "vanilla"):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.embed = nn.Embedding(vocab, rank)  # W1
        self.out = nn.Linear(rank, draft_vocab, bias=False)  # W2
        self.cell = nn.Linear(2 * rank + hidden, 3 * rank) if kind == "rnn" else None

    def step(self, prev: torch.Tensor, h: torch.Tensor, s: Optional[torch.Tensor]):
        """One position: prev [...] ids, h [..., d] -> (bias [..., K], W1[prev], new state)."""
        e = self.embed(prev)
        if self.cell is None:
            return self.out(e), e, s
        if s is None:
            s = e.new_zeros(*e.shape[:-1], self.rank)
        gz, cz, oz = self.cell(torch.cat([s, e, h.to(e.dtype)], -1)).split(self.rank, -1)
        gate = torch.sigmoid(gz)
        s_new = gate * s + (1 - gate) * torch.tanh(cz)
        return self.out(torch.tanh(oz)), e, s_new

    def teacher_forced(self, prev: torch.Tensor, h: torch.Tensor):
        """prev [..., g], h [..., g, d] -> bias [..., g, K], W1[prev] [..., g, r]."""
        if self.cell is None:
            e = self.embed(prev)
            return self.out(e), e
        s, bs, es = None, [], []
        for k in range(prev.shape[-1]):
            b, e, s = self.step(prev[..., k], h[..., k, :], s)
            bs.append(b)
            es.append(e)
        return torch.stack(bs, -2), torch.stack(es, -2)


class ConfidenceHead(nn.Module):
    """Eq. 7: the logit of c_k = sig(w^T [h_k; W1[x_{k-1}]] + b), one
    Linear(d + r -> 1) over the draft hidden state and the Markov head's
    embedding of the previous token (`with_markov`; Linear(d -> 1) on h_k
    alone without it). It predicts the conditional acceptance of position k."""

    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + (rank if with_markov else 0), 1)

    def forward(self, h: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        """h [..., d], e = W1[x_{k-1}] [..., r] (ignored without the Markov input) -> logits [...]."""
        z = torch.cat([h, e.to(h.dtype)], -1) if self.with_markov else h
        return self.proj(z).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    distills = True  # Eq. 12: CE + L1 to p_t + the confidence BCE

    def _build_heads(self, config) -> None:
        r = config.deepspec_markov_rank
        d = config.hidden_size
        K = config.deepspec_draft_vocab_size or config.deepspec_target_vocab_size
        self.markov = (
            MarkovHead(config.deepspec_target_vocab_size, K, r, d, config.deepspec_markov_head_type) if r > 0 else None
        )
        self.confidence = None
        if config.deepspec_confidence_head:
            with_markov = bool(config.deepspec_confidence_with_markov and self.markov is not None)
            self.confidence = ConfidenceHead(d, r, with_markov)

    def block_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """U_k + B_k (teacher forced), [..., g, K]."""
        base = self.draft_logits(h)
        if self.markov is None:
            return base
        bias, _ = self.markov.teacher_forced(prev, h)
        return base + bias.to(base.dtype)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> Optional[torch.Tensor]:
        """Teacher-forced confidence logits [..., g] (Eq. 7), or None."""
        if self.confidence is None:
            return None
        return self.confidence(h, self.markov.embed(prev) if self.confidence.with_markov else None)

    def _sample_block(self, h, anchor, temperature, generator, stop=None):
        """The serial Markov loop over the block (Eq. 5), with each position's
        confidence logit (Eq. 7); it ends early where `stop` says no verification
        will reach past the position just drafted."""
        if self.markov is None and self.confidence is None:
            return super()._sample_block(h, anchor, temperature, generator)
        base = self.draft_logits(h)  # [R,g,K]; the backbone is not run again below
        prev, s = anchor, None
        toks, probs, confs = [], [], []
        for k in range(self.gamma):
            logits, e = base[:, k], None
            if self.markov is not None:
                bias, e, s = self.markov.step(prev, h[:, k], s)
                logits = logits + bias.to(logits.dtype)  # before softmax and before temperature
            p = verify.logits_to_probs(logits, temperature)
            idx = verify.draw(p, temperature, generator)  # [R]: one stream per request when a list
            if self.confidence is not None:
                confs.append(self.confidence(h[:, k], e))
            tok = self.to_target_ids(idx)
            toks.append(tok)
            probs.append(p)
            prev = tok
            if stop is not None and confs and stop(torch.stack(confs, 1)):
                break
        conf = torch.stack(confs, 1).float() if confs else None
        return torch.stack(toks, 1), torch.stack(probs, 1), conf

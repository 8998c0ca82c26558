"""Eagle3 chain drafter as used by DeepSpec (notes §3-4, §6.4; EAGLE-3 with
training-time test, 7 steps, chain drafting, full vocabulary by default).

Input of the single decoder layer at row t:
    x = W_in [RMSNorm_e(emb(token)); RMSNorm_h(hidden)]      (Linear(2d -> d))
where `hidden` is the fused target features fc([h^(l1); ...; h^(lm)]) at step 0
and the draft's own (pre-norm) output hidden from the previous step afterwards;
the layer is the target architecture's standard transformers decoder layer
(Gemma4: Gemma4TextDecoderLayer of the all-full-attention draft config, with
its sandwich norms, q/k/v norms, attention_k_eq_v and layer_scalar).
Design choice: the reference (SpecForge) instead feeds the 2d concatenation
straight into a modified attention (q/k/v projections of width 2d). The
Linear(2d -> d) variant reuses the stock decoder layer unchanged; the two are
equally expressive up to the first projection, but released reference
checkpoints cannot be loaded into this layout.

Training-time test (TTT, `forward`): step 0 pairs the target features at
position t with token t+1 and predicts token t+2; step s > 0 replaces the target
features by the draft's step-(s-1) output at the same row and uses token t+1+s
(teacher forced), predicting t+2+s, at RoPE position t+s. Row t of step s
attends to step-0 keys j <= t (the context) and to its own chain (row t of
steps 1..s) - the TTT mask.

Inference (`propose`): the verified context goes into a KV cache (step 0), then
gamma tokens are drafted autoregressively from the last context row, appending
chain K/V; the cache is cropped back to the context afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..core import verify
from ..core.target import cache_kwarg
from ..core.train_step import chain_step
from .base import DrafterBase, Proposal
from .blocks import KVStore


def ttt_mask(L: int, step: int, device=None) -> torch.Tensor:
    """[1, 1, L, (step+1)*L] boolean: causal over step-0 keys, diagonal over
    the keys of steps 1..step."""
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    eye = torch.eye(L, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1).view(1, 1, L, -1)


@dataclass
class ChainState:
    cache: KVStore = field(default_factory=KVStore)
    n: int = 0
    last_hidden: Optional[torch.Tensor] = None  # pre-norm output of the last context row [1,1,d]


class Eagle3Drafter(DrafterBase):
    training_step = chain_step

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.fc, _ = self.feature_projection()
        self.emb_norm = self.blocks.RMSNorm(d, eps=config.rms_norm_eps)
        self.hidden_norm = self.blocks.RMSNorm(d, eps=config.rms_norm_eps)
        self.in_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(self.blocks.DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.blocks.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = self.blocks.RotaryEmbedding(config=config)
        self.post_init()

    @property
    def gamma(self) -> int:
        return self.config.deepspec_ttt_length

    def _layer_kwargs(self) -> dict:
        """Gemma4TextDecoderLayer stores the K/V of the last layer of each attention
        type in a `shared_kv_states` dict (for KV-sharing layers); the draft shares
        nothing, so it gets a fresh dict per step."""
        return {"shared_kv_states": {}} if self.blocks.family == "gemma4" else {}

    def _step(self, tokens, hidden, pos, mask, cache):
        """One chain step over rows: returns the pre-norm output hidden [B, L, d]."""
        x = self.in_proj(torch.cat([self.emb_norm(self.embed(tokens)), self.hidden_norm(hidden)], -1))
        cos, sin = self.rotary(x, pos)
        for layer in self.layers:
            kw = {cache_kwarg(layer): cache, **self._layer_kwargs()}
            x = layer(x, attention_mask=mask, position_embeddings=(cos, sin), use_cache=True, **kw)
        return x

    def forward(self, input_ids, features, attention_mask=None, steps: Optional[int] = None):
        """TTT pass. Returns a list over steps s of post-norm hidden states
        [B, L, d]; row t of step s predicts token t+2+s."""
        B, L = input_ids.shape
        S = steps or self.gamma
        hidden = self.fc(features.to(self.fc.weight.dtype))
        cache = KVStore()
        outs = []
        idx = torch.arange(L, device=input_ids.device)
        for s in range(S):
            tok = input_ids.gather(1, (idx + 1 + s).clamp(max=L - 1).expand(B, L))
            pos = (idx + s).expand(B, L)
            hidden = self._step(tok, hidden, pos, ttt_mask(L, s, input_ids.device), cache)
            outs.append(self.norm(hidden))
        return outs

    def block_logits(self, h, prev=None):
        return self.draft_logits(h)

    # -- inference ----------------------------------------------------------------------
    def init_state(self) -> ChainState:
        return ChainState()

    @torch.no_grad()
    def propose(self, state: ChainState, feats, tokens, temperature: float = 1.0, generator=None) -> Proposal:
        dev = self.device
        n = feats.shape[1]
        if n > 0:
            P0 = state.n
            hid = self.fc(feats.to(dev, self.fc.weight.dtype))
            pos = torch.arange(P0, P0 + n, device=dev).unsqueeze(0)
            mask = (torch.arange(P0 + n, device=dev).view(1, -1) <= (P0 + torch.arange(n, device=dev)).view(-1, 1))
            g = self._step(tokens[:, 1 : n + 1].to(dev), hid, pos, mask.view(1, 1, n, P0 + n), state.cache)
            state.n += n
            state.last_hidden = g[:, -1:]
        P = state.n
        g = state.last_hidden
        toks, probs = [], []
        for k in range(self.gamma):
            p = verify.logits_to_probs(self.draft_logits(self.norm(g))[:, -1], temperature)
            idx = p.argmax(-1) if verify.is_greedy(temperature) else verify.sample(p, generator)
            tok = self.to_target_ids(idx)
            toks.append(tok)
            probs.append(p)
            if k + 1 < self.gamma:
                pos = torch.full((1, 1), P + k, device=dev, dtype=torch.long)
                g = self._step(tok.view(1, 1), g, pos, None, state.cache)
        state.cache.crop(P)  # keep only verified context
        return Proposal(
            tokens=torch.stack(toks, 1), probs=self.to_full_vocab(torch.stack(probs, 1)).float(), conf_logits=None
        )

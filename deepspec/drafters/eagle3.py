"""Eagle3 chain drafter: the standard EAGLE-3 layer (paper Sec. 4.1; DeepSpec's
deepspec/modeling/eagle3/; EAGLE-3 with
training-time test, 7 steps, chain drafting, full vocabulary by default).

The layer (`Eagle3Layer`), as in DeepSeek's `Qwen3Eagle3DecoderLayer`, SpecForge's
`LlamaForCausalLMEagle3` and vLLM's `llama_eagle3.py` / `qwen3_eagle3.py`:

    residual = g
    x = [input_layernorm(emb(token)); hidden_norm(g)]           (width 2d)
    h = residual + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))  (q/k/v: Linear(2d -> heads*hd))
    out = h + mlp(post_attention_layernorm(h))

where `g` is the fused target features fc([h^(l1); ...; h^(lm)]) at step 0 and
the draft's own pre-norm output of the previous step afterwards (every layer of
a deeper draft takes the same token embedding and the previous layer's output).
The attention is transformers' attention module of the target architecture with
its q/k/v projections widened to 2d inputs (Qwen3: q/k RMSNorm per head; Llama:
none). Gemma4 targets (`Gemma4Eagle3Layer`) follow DeepSeek's
`Gemma4Eagle3DecoderLayer`: Gemma4TextAttention of the all-full-attention draft
config (q/k norms, scale-free value norm, keys as values with attention_k_eq_v,
scaling 1), sandwich norms (post-attention norm on the attention output before
the residual, pre/post feed-forward norms) and the output times `layer_scalar`.
Parameter names are the reference's (`fc`, `layers.{i}.hidden_norm`,
`layers.{i}.input_layernorm`, `layers.{i}.self_attn.*`, ..., `norm`), so
released checkpoints map one to one (formats/convert.py).

Training-time test (TTT, `forward`): step 0 pairs the target features at
position t with token t+1 and predicts token t+2; step s > 0 replaces the target
features by the draft's step-(s-1) output at the same row and uses token t+1+s
(teacher forced), predicting t+2+s, at RoPE position t+s. Row t of step s
attends to step-0 keys j <= t (the context) and to its own chain (row t of
steps 1..s) - the TTT mask. Rows' chains are independent past step 0, so
training may run steps s > 0 on chosen rows only (`rows`, `chain_rows_mask`;
train.chain_rows), each kept row's states those of the full pass.

Inference (`propose`): the verified context goes into a KV cache (step 0), then
gamma tokens are drafted autoregressively from the last context row, appending
chain K/V; the cache is cropped back to the context afterwards. `propose_batch`
(the batched engine) runs the chain steps for R requests at once over their
right-padded contexts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..core import verify
from ..core.decode import Proposal
from ..core.target import cache_kwarg
from ..core.train_step import chain_step
from .base import DrafterBase
from .blocks import KVStore, stack_padded


def ttt_mask(L: int, step: int, device=None) -> torch.Tensor:
    """[1, 1, L, (step+1)*L] boolean: causal over step-0 keys, diagonal over
    the keys of steps 1..step."""
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    eye = torch.eye(L, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1).view(1, 1, L, -1)


def chain_rows_mask(rows: torch.Tensor, L: int, step: int) -> torch.Tensor:
    """[B, 1, R, L + step*R] boolean for the chains of `rows` [B, R] only: row
    t attends to step-0 keys j <= t and to its own chain's keys of steps 1..step."""
    R = rows.shape[1]
    causal = torch.arange(L, device=rows.device).view(1, 1, L) <= rows.unsqueeze(-1)
    eye = torch.eye(R, dtype=torch.bool, device=rows.device).expand(rows.shape[0], R, R)
    return torch.cat([causal] + [eye] * step, dim=2).unsqueeze(1)


def widen(lin: nn.Linear, in_features: int) -> nn.Linear:
    """A fresh Linear(in_features -> lin.out_features) with lin's bias setting."""
    return nn.Linear(in_features, lin.out_features, bias=lin.bias is not None)


class Eagle3Layer(nn.Module):
    """The standard EAGLE-3 decoder layer (module docstring) on transformers'
    attention / MLP / RMSNorm of the target architecture."""

    def __init__(self, config, layer_idx: int, blocks):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self._attention(config, layer_idx, blocks)
        self.mlp = blocks.MLP(config, layer_idx) if blocks.family == "gemma4" else blocks.MLP(config)
        self.hidden_norm = blocks.RMSNorm(d, eps=eps)
        self.input_layernorm = blocks.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = blocks.RMSNorm(d, eps=eps)
        self._gemma4 = blocks.family == "gemma4"

    @staticmethod
    def _attention(config, layer_idx, blocks):
        a = blocks.Attention(config=config, layer_idx=layer_idx)
        for name in ("q_proj", "k_proj", "v_proj"):
            if getattr(a, name, None) is not None:  # Gemma4 with attention_k_eq_v has no v_proj
                setattr(a, name, widen(getattr(a, name), 2 * config.hidden_size))
        return a

    def attend(self, emb, g, cos, sin, mask, cache):
        """o_proj(attn(x)) for x = [input_layernorm(emb); hidden_norm(g)]."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)
        kw = {cache_kwarg(self.self_attn): cache}
        if self._gemma4:
            kw["shared_kv_states"] = {}  # the draft shares no K/V across layers
        return self.self_attn(x, position_embeddings=(cos, sin), attention_mask=mask, **kw)[0]

    def forward(self, emb, g, cos, sin, mask=None, cache=None):
        h = g + self.attend(emb, g, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Gemma4Eagle3Layer(Eagle3Layer):
    """DeepSeek's Gemma4 Eagle3 layer: sandwich norms and `layer_scalar`."""

    def __init__(self, config, layer_idx: int, blocks):
        super().__init__(config, layer_idx, blocks)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = blocks.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = blocks.RMSNorm(d, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, emb, g, cos, sin, mask=None, cache=None):
        h = g + self.post_attention_layernorm(self.attend(emb, g, cos, sin, mask, cache))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


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
        layer_cls = Gemma4Eagle3Layer if self.blocks.family == "gemma4" else Eagle3Layer
        self.layers = nn.ModuleList(layer_cls(config, i, self.blocks) for i in range(config.num_hidden_layers))
        self.norm = self.blocks.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = self.blocks.RotaryEmbedding(config=config)
        self.post_init()

    @property
    def gamma(self) -> int:
        return self.config.deepspec_ttt_length

    def _step(self, tokens, hidden, pos, mask, cache):
        """One chain step over rows: returns the pre-norm output hidden [B, L, d]."""
        emb = self.embed(tokens).to(hidden.dtype)
        cos, sin = self.rotary(hidden, pos)
        for layer in self.layers:
            hidden = layer(emb, hidden, cos, sin, mask, cache)
        return hidden

    def forward(self, input_ids, features, attention_mask=None, steps: Optional[int] = None,
                rows: Optional[torch.Tensor] = None):
        """TTT pass. Returns a list over steps s of post-norm hidden states
        [B, L, d]; row t of step s predicts token t+2+s. With `rows` [B, R]
        (positions), steps s > 0 run only those rows' chains ([B, R, d]): a
        row's chain reads the step-0 keys and its own chain, nothing of other
        rows' chains, so each kept row's states are those of the full pass."""
        B, L = input_ids.shape
        S = steps or self.gamma
        hidden = self.fc(features.to(self.fc.weight.dtype))
        cache = KVStore()
        outs = []
        dev = input_ids.device
        idx = torch.arange(L, device=dev).expand(B, L)
        for s in range(S):
            if s == 1 and rows is not None:
                idx = rows
                hidden = hidden.gather(1, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            tok = input_ids.gather(1, (idx + 1 + s).clamp(max=L - 1))
            mask = ttt_mask(L, s, dev) if rows is None or s == 0 else chain_rows_mask(rows, L, s)
            hidden = self._step(tok, hidden, idx + s, mask, cache)
            outs.append(self.norm(hidden))
        return outs

    def block_logits(self, h, prev=None):
        return self.draft_logits(h)

    # -- inference ----------------------------------------------------------------------
    def init_state(self) -> ChainState:
        return ChainState()

    def _extend_context(self, state: ChainState, feats, tokens) -> None:
        """Step 0 over the newly verified rows (feats [1, n, m*d], tokens [1, n+1]):
        their K/V join the request's cache, the last row's output seeds the chain."""
        dev, n = self.device, feats.shape[1]
        if n == 0:
            return
        P0 = state.n
        hid = self.fc(feats.to(dev, self.fc.weight.dtype))
        pos = torch.arange(P0, P0 + n, device=dev).unsqueeze(0)
        mask = (torch.arange(P0 + n, device=dev).view(1, -1) <= (P0 + torch.arange(n, device=dev)).view(-1, 1))
        g = self._step(tokens[:, 1 : n + 1].to(dev), hid, pos, mask.view(1, 1, n, P0 + n), state.cache)
        state.n += n
        state.last_hidden = g[:, -1:]

    def _draw(self, g, temperature, generator):
        """Next draft token of every row from the pre-norm hidden g [R, 1, d]: (target ids [R], probs [R, V_d])."""
        p = verify.logits_to_probs(self.draft_logits(self.norm(g))[:, -1], temperature)
        idx = verify.draw(p, temperature, generator)
        return self.to_target_ids(idx), p

    @torch.no_grad()
    def propose(self, state: ChainState, feats, tokens, temperature: float = 1.0, generator=None) -> Proposal:
        self._extend_context(state, feats, tokens)
        P = state.n
        pos0 = torch.full((1,), P, device=self.device, dtype=torch.long)
        toks, probs = self._run_chain(state.last_hidden, pos0, state.cache, lambda k: None, temperature, generator)
        state.cache.crop(P)  # keep only verified context
        return Proposal(tokens=toks, probs=self.to_full_vocab(probs).float(), conf_logits=None)

    def _run_chain(self, g, pos0, cache, mask_at, temperature, generator):
        """gamma draft steps from the pre-norm hidden g [R, 1, d]; step k's query sits
        at RoPE position pos0 + k [R] and attends through `cache` with mask_at(k).
        Returns (target-id tokens [R, gamma], draft-vocab probs [R, gamma, V_d])."""
        toks, probs = [], []
        for k in range(self.gamma):
            tok, p = self._draw(g, temperature, generator)
            toks.append(tok)
            probs.append(p)
            if k + 1 < self.gamma:
                g = self._step(tok.view(-1, 1), g, (pos0 + k).view(-1, 1), mask_at(k), cache)
        return torch.stack(toks, 1), torch.stack(probs, 1)

    @torch.no_grad()
    def propose_batch(self, states, feats, tokens, temperature: float = 1.0, generator=None) -> Proposal:
        """One drafter call for R requests (the batched engine, core/engine.py): each
        request's new context goes through its own cache (step 0, as in `propose`),
        then the gamma chain steps run once per group of requests with similar
        context lengths (core.batch_cache.row_groups); row r's query attends to its own
        context (right-padded to its group's longest, padding masked) and its own
        chain. `generator` is one torch.Generator or one per request (a row then
        draws from its stream exactly as it would alone). Returns [R, gamma] tokens
        and [R, gamma, V] probs."""
        from ..core import batch_cache

        for s, f, t in zip(states, feats, tokens):
            self._extend_context(s, f, t)
        R = len(states)
        groups = (batch_cache.row_groups(torch.tensor([s.n for s in states]), batch_cache.DRAFT_GROUP_OVERHEAD)
                  if R > 1 else [])
        if len(groups) <= 1:
            toks, probs = self._chain(states, temperature, generator)
        else:
            per_row = isinstance(generator, (list, tuple))
            toks, probs = None, None
            for idx, _ in groups:
                rows = idx.tolist()
                t, p = self._chain([states[i] for i in rows], temperature,
                                   [generator[i] for i in rows] if per_row else generator)
                if toks is None:
                    toks, probs = t.new_empty(R, *t.shape[1:]), p.new_empty(R, *p.shape[1:])
                toks[idx.to(t.device)], probs[idx.to(p.device)] = t, p
        return Proposal(tokens=toks, probs=self.to_full_vocab(probs).float(), conf_logits=None)

    def _chain(self, states, temperature, generator):
        """The gamma chain steps for these requests over their right-padded contexts:
        (target-id tokens [R, gamma], draft-vocab probs [R, gamma, V_d])."""
        dev, R = self.device, len(states)
        ns = torch.tensor([s.n for s in states], device=dev)
        L = int(ns.max())
        chain = KVStore()  # the padded contexts, then the chain's own K/V
        for i in states[0].cache.k:
            chain.k[i] = stack_padded([s.cache.k[i] for s in states], L)
            chain.v[i] = stack_padded([s.cache.v[i] for s in states], L)
        ctx_valid = torch.arange(L, device=dev)[None] < ns[:, None]  # [R, L]

        def mask_at(k):  # own context (padding masked) and own chain so far
            return torch.cat([ctx_valid, ctx_valid.new_ones(R, k + 1)], 1).view(R, 1, 1, L + k + 1)

        return self._run_chain(torch.cat([s.last_hidden for s in states]), ns, chain, mask_at, temperature, generator)

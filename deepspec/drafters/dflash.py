"""DFlash block drafter as used by DeepSpec (paper Eqs. 2-3; DeepSpec's
deepspec/modeling/dspark/, block 7 with the anchor predicting draft token 1).

One forward pass drafts a whole block of gamma tokens: the inputs are the anchor
token (the last emitted token) followed by gamma-1 mask embeddings, and the
anchor position itself predicts draft token 1 (gamma inputs -> gamma logits).
This is DeepSpec's variant; z-lab DFlash uses anchor + gamma masks and predicts
only the masks (block 16).

Context injection (Eq. 3): in every layer K = [W_K H_ctx; W_K H_d] and
V = [W_V H_ctx; W_V H_d], with H_ctx = RMSNorm(W_c [h^(l1); ...; h^(lm)])
(Eq. 2) shared by all layers; queries come only from block tokens. A block
anchored at position p sees the context at positions < p and, bidirectionally,
its own block; never later context. RoPE uses absolute positions: context i at
i, block token j at p+j.

Training (`forward`) processes many anchors per sequence at once: the block rows
are extra query rows after the context, with one mask: a dense boolean mask
through sdpa on CPU (`block_attention_mask`), the same rule as a flex_attention
BlockMask on CUDA (`block_flex_mask`), which skips the masked-out tiles.
Inference (`propose`) caches per-layer context K/V in the state; the block's own
K/V are never stored, so the cache holds only verified context.

Gemma4 targets (`Gemma4KVInjectionLayer`) follow the reference's Gemma4 DSpark
layer instead: q/k RMSNorms per head, a scale-free RMSNorm on values, keys
reused as values when attention_k_eq_v, attention scale 1, Gemma's norms after
attention and around the MLP, and the output times `layer_scalar`.

The block's mask input: with drafter.mask_token_id (the paper presets: 151669
on Qwen3, 4 on Gemma4) it is the target's frozen embedding of that reserved
token, as in the reference (`drafters.freeze_mask_embedding`); without one
(SmolLM2 has no reserved token) it is a learned vector, our departure from the
reference. The DSpark heads (Markov bias, confidence)
are hooks here that DFlash leaves empty: DFlash = DSpark with markov_rank 0 and
no confidence head, exactly as in the reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..core import verify
from ..core.decode import Proposal
from ..core.train_step import block_step
from .base import DrafterBase
from .blocks import apply_rope, attention, rope, stack_padded, uses_flex


def heads(lin, norm, x, head_dim: int) -> torch.Tensor:
    """lin(x) [B, L, H*hd] as heads [B, H, L, hd], each RMS-normed when `norm` is given."""
    y = lin(x).view(*x.shape[:-1], -1, head_dim)
    if norm is not None:  # Qwen3's / Gemma4's per-head q/k RMSNorm
        y = norm(y)
    return y.transpose(1, 2)


class KVInjectionLayer(nn.Module):
    """A target-architecture decoder layer (attention, MLP, RMSNorms from
    transformers) whose attention also attends to injected context K/V."""

    def __init__(self, config, layer_idx: int, blocks):
        super().__init__()
        self.self_attn = blocks.Attention(config=config, layer_idx=layer_idx)
        self.mlp = blocks.MLP(config)
        self.input_layernorm = blocks.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = blocks.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _proj(self, lin, norm, x):
        return heads(lin, norm, x, self.self_attn.head_dim)

    def context_kv(self, ctx, cos, sin):
        """K/V of the injected context H_ctx [B, Lc, d] (rotated at context positions)."""
        a = self.self_attn
        k = rope(self._proj(a.k_proj, getattr(a, "k_norm", None), ctx), cos, sin)
        v = self._proj(a.v_proj, None, ctx)
        return k, v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask: Optional[torch.Tensor]):
        a = self.self_attn
        h = self.input_layernorm(x)
        q = self._proj(a.q_proj, getattr(a, "q_norm", None), h)
        k = self._proj(a.k_proj, getattr(a, "k_norm", None), h)
        v = self._proj(a.v_proj, None, h)
        q, k = apply_rope(q, k, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        x = x + a.o_proj(attention(a, q, k, v, mask))
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma4KVInjectionLayer(nn.Module):
    """The injection layer with Gemma4 semantics (reference: deepseek-ai/DeepSpec
    deepspec/modeling/dspark/gemma4/modeling.py, Gemma4DSparkAttention and
    Gemma4DSparkDecoderLayer), built from transformers' Gemma4 modules:

    * attention = Gemma4TextAttention of the all-full-attention draft config:
      head_dim = global_head_dim, K/V heads = num_global_key_value_heads with
      attention_k_eq_v (then v_proj is None and the un-normed keys are the
      values), q_norm/k_norm per head, v_norm without scale, scaling 1.0;
    * RoPE after the q/k norms, at full-attention frequencies;
    * x = x + post_attention_layernorm(attn(input_layernorm(x)));
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)));
      out = x * layer_scalar (a buffer of ones, as in the reference).
    Parameter names match transformers' Gemma4TextDecoderLayer (init_from_target)."""

    def __init__(self, config, layer_idx: int, blocks):
        super().__init__()
        self.self_attn = blocks.Attention(config=config, layer_idx=layer_idx)
        self.mlp = blocks.MLP(config, layer_idx)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = blocks.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = blocks.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = blocks.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = blocks.RMSNorm(d, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def _kv(self, x):
        """Un-rotated K (k_norm) and V (scale-free v_norm) of x, [B, Hkv, L, hd]."""
        a = self.self_attn
        k = a.k_proj(x).view(*x.shape[:-1], -1, a.head_dim)
        v = k if a.v_proj is None else a.v_proj(x).view(*x.shape[:-1], -1, a.head_dim)  # attention_k_eq_v
        return a.k_norm(k).transpose(1, 2), a.v_norm(v).transpose(1, 2)

    def context_kv(self, ctx, cos, sin):
        k, v = self._kv(ctx)
        return rope(k, cos, sin), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask: Optional[torch.Tensor]):
        a = self.self_attn
        h = self.input_layernorm(x)
        q = heads(a.q_proj, a.q_norm, h, a.head_dim)
        k, v = self._kv(h)
        q, k = apply_rope(q, k, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        x = x + self.post_attention_layernorm(a.o_proj(attention(a, q, k, v, mask)))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, gamma: int) -> torch.Tensor:
    """Training mask [B, 1, N*g, Lc + N*g] (True = attend): block rows of anchor p
    see context keys i < p and every row of their own block."""
    B, N = anchors.shape
    dev = anchors.device
    ctx = torch.arange(ctx_len, device=dev).view(1, 1, 1, -1) < anchors.view(B, N, 1, 1)  # [B,N,1,Lc]
    ctx = ctx.expand(B, N, gamma, ctx_len).reshape(B, N * gamma, ctx_len)
    blk = torch.arange(N, device=dev).repeat_interleave(gamma)
    own = (blk.view(-1, 1) == blk.view(1, -1)).expand(B, -1, -1)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def block_mask_mod(anchors: torch.Tensor, ctx_len: int, gamma: int):
    """`block_attention_mask`'s rule as a flex_attention mask_mod (b, h, q, kv) ->
    bool: query row q belongs to block q // gamma, anchored at p = anchors[b, q // gamma];
    key kv < ctx_len is context position kv (seen when kv < p), key kv >= ctx_len is
    row kv - ctx_len of the blocks (seen when in the same block). Indices past the
    query length (the kernel's padded tail) are clamped into range."""
    last = anchors.shape[1] - 1

    def mask_mod(b, h, q, kv):
        blk = torch.clamp(q // gamma, max=last)
        return torch.where(kv < ctx_len, kv < anchors[b, blk], (kv - ctx_len) // gamma == blk)

    return mask_mod


def block_flex_mask(anchors: torch.Tensor, ctx_len: int, gamma: int, block_size: int = 128):
    """The training mask of `block_attention_mask` as a flex BlockMask (the CUDA
    training path): tiles of block_size x block_size scores that the rule masks out
    entirely are skipped, e.g. the context after a tile's last anchor and other
    blocks' rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors.shape
    return create_block_mask(block_mask_mod(anchors, ctx_len, gamma), B, None, N * gamma, ctx_len + N * gamma,
                             device=anchors.device, BLOCK_SIZE=block_size)


@dataclass
class BlockState:
    """Per-request inference state: per-layer context K/V and its length."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    n: int = 0


class DFlashDrafter(DrafterBase):
    training_step = block_step
    # The training pass's attention: "auto" = flex_attention with a BlockMask on
    # CUDA (head_dim <= 256, `blocks.uses_flex`), sdpa with the dense boolean mask
    # elsewhere; "flex" / "sdpa" force one.
    attention_backend = "auto"

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.fc, self.hidden_norm = self.feature_projection()
        layer_cls = Gemma4KVInjectionLayer if self.blocks.family == "gemma4" else KVInjectionLayer
        self.layers = nn.ModuleList(layer_cls(config, i, self.blocks) for i in range(config.num_hidden_layers))
        self.norm = self.blocks.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = self.blocks.RotaryEmbedding(config=config)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self._build_heads(config)
        self.post_init()

    def _build_heads(self, config) -> None:  # DSpark adds its heads here
        pass

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            std = getattr(self.config, "initializer_range", 0.02) or 0.02
            nn.init.normal_(self.mask_embedding, std=std)

    @property
    def gamma(self) -> int:
        return self.config.deepspec_block_size

    # -- backbone -------------------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx (Eq. 2)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[..., g, d]: anchor embedding then g-1 mask embeddings."""
        e = self.embed(anchor_tokens).unsqueeze(-2)
        m = self.mask_embedding.to(e.dtype).expand(*e.shape[:-2], self.gamma - 1, e.shape[-1])
        return torch.cat([e, m], dim=-2)

    def forward(self, input_ids, features, anchors, attention_mask=None):
        """Training pass. input_ids [B,L], features [B,L,m*d], anchors [B,N] ->
        post-norm draft hidden states h [B, N, g, d] (row j predicts token p+1+j)."""
        B, L = input_ids.shape
        N, g = anchors.shape[1], self.gamma
        ctx = self.context(features)
        x = self.block_inputs(input_ids.gather(1, anchors)).reshape(B, N * g, -1)
        ctx_pos = torch.arange(L, device=ctx.device).expand(B, L)
        blk_pos = (anchors.unsqueeze(-1) + torch.arange(g, device=ctx.device)).reshape(B, N * g)
        cos_c, sin_c = self.rotary(ctx, ctx_pos)
        cos_b, sin_b = self.rotary(x, blk_pos)
        mask = self.training_mask(anchors, L)
        for layer in self.layers:
            ck, cv = layer.context_kv(ctx, cos_c, sin_c)
            x = layer(x, ck, cv, cos_b, sin_b, mask)
        return self.norm(x).view(B, N, g, -1)

    def training_mask(self, anchors: torch.Tensor, ctx_len: int):
        """The training pass's mask: a flex BlockMask on CUDA (`attention_backend`),
        else the dense boolean mask; both express `block_attention_mask`'s rule."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        flex = uses_flex(self.attention_backend, anchors.device.type, head_dim)
        return (block_flex_mask if flex else block_attention_mask)(anchors, ctx_len, self.gamma)

    # -- heads (hooks; DSpark overrides) -------------------------------------------------
    def block_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced draft logits [..., g, K] (DFlash: base logits U_k only)."""
        return self.draft_logits(h)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def _sample_block(self, h, anchor, temperature, generator, stop=None):
        """DFlash: positions are independent given the block pass (h [R,g,d]);
        without confidences there is nothing for `stop` to read."""
        probs = verify.logits_to_probs(self.draft_logits(h), temperature)  # [R,g,K]
        return self.to_target_ids(verify.draw(probs, temperature, generator)), probs, None

    # -- inference ----------------------------------------------------------------------
    def init_state(self) -> BlockState:
        return BlockState(k=[None] * len(self.layers), v=[None] * len(self.layers), n=0)

    @torch.no_grad()
    def propose(self, state: BlockState, feats, tokens, temperature: float = 1.0, generator=None,
                stop=None) -> Proposal:
        """feats [1, n, m*d] of the newly verified positions, tokens [1, n+1] (their
        tokens then the anchor). Appends context K/V, drafts gamma tokens, or fewer
        where `stop` (given the confidence logits [1, k] so far) says the k-th is the
        last any verification will reach (`policies.LiveAlgorithm1.stop_after`)."""
        return self.propose_batch([state], [feats], [tokens], temperature=temperature, generator=generator, stop=stop)

    @torch.no_grad()
    def propose_batch(self, states, feats, tokens, temperature: float = 1.0, generator=None, stop=None) -> Proposal:
        """One drafter call for R requests (the batched engine, core/engine.py):
        states, feats [1, n_r, m*d] and tokens [1, n_r+1] per request; `generator`
        is one torch.Generator or a list with one per request (each row then draws
        from its own stream exactly as it would alone). Returns a Proposal with
        [R, gamma] tokens, [R, gamma, V] probs and [R, gamma] conf_logits (or None)."""
        self._extend_context(states, feats)
        anchor = torch.cat([t[:, -1] for t in tokens]).to(self.device)  # [R]
        h = self._grouped_block_hidden(states, anchor)
        toks, probs, conf = self._sample_block(h, anchor, temperature, generator, stop)
        return Proposal(tokens=toks, probs=self.to_full_vocab(probs).float(), conf_logits=conf)

    def _extend_context(self, states, feats) -> None:
        """Append each request's newly verified context K/V to its state. The
        context projection and K/V are per position (no attention), so all
        requests' new positions go through one packed call."""
        dev = self.device
        n = [f.shape[1] for f in feats]
        if sum(n) == 0:
            return
        ctx = self.context(torch.cat([f.to(dev) for f in feats], 1))  # [1, sum n, d]
        pos = torch.cat([torch.arange(s.n, s.n + k, device=dev) for s, k in zip(states, n)]).unsqueeze(0)
        cos, sin = self.rotary(ctx, pos)
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(ctx, cos, sin)
            for s, ks, vs in zip(states, k.split(n, 2), v.split(n, 2)):
                if ks.shape[2]:
                    s.k[i] = ks if s.k[i] is None else torch.cat([s.k[i], ks], 2)
                    s.v[i] = vs if s.v[i] is None else torch.cat([s.v[i], vs], 2)
        for s, k in zip(states, n):
            s.n += k

    def _grouped_block_hidden(self, states, anchor) -> torch.Tensor:
        """`_block_hidden` over groups of requests with similar context lengths
        (core.batch_cache.row_groups; rows are independent), so that one long context
        does not pad every request's context to its length."""
        from ..core import batch_cache

        groups = (batch_cache.row_groups(torch.tensor([s.n for s in states]), batch_cache.DRAFT_GROUP_OVERHEAD)
                  if len(states) > 1 else [])
        if len(groups) <= 1:
            return self._block_hidden(states, anchor)
        h = None
        for idx, _ in groups:
            hg = self._block_hidden([states[i] for i in idx.tolist()], anchor[idx.to(anchor.device)])
            h = hg.new_empty(len(states), *hg.shape[1:]) if h is None else h
            h[idx.to(h.device)] = hg
        return h

    def _block_hidden(self, states, anchor) -> torch.Tensor:
        """The block pass for R requests: anchor + masks attend to each request's own
        verified context (right-padded to the longest, padding masked) and, fully, to
        their own block. Returns post-norm hidden states [R, gamma, d]."""
        dev, g = self.device, self.gamma
        x = self.block_inputs(anchor)  # [R,g,d]
        ns = torch.tensor([s.n for s in states], device=dev)
        cos, sin = self.rotary(x, ns.unsqueeze(1) + torch.arange(g, device=dev))
        L, mask = int(ns.max()), None
        if int(ns.min()) != L:  # ragged contexts: mask each row's padding keys
            keys = torch.arange(L + g, device=dev)
            mask = ((keys < ns[:, None]) | (keys >= L)).view(len(states), 1, 1, L + g).expand(-1, 1, g, -1)
        for i, layer in enumerate(self.layers):
            ck = _padded([s.k[i] for s in states], L, layer, x)
            cv = _padded([s.v[i] for s in states], L, layer, x)
            x = layer(x, ck, cv, cos, sin, mask)  # full attention: verified context + own block
        return self.norm(x)


def _padded(kvs, L: int, layer, x) -> torch.Tensor:
    """Per-request context K or V [1, H, n_r, hd] right-padded to [R, H, L, hd]."""
    if len(kvs) == 1 and kvs[0] is not None:
        return kvs[0]
    ref = next((t for t in kvs if t is not None), None)
    if ref is None:  # no context yet anywhere
        a = layer.self_attn
        return x.new_zeros(len(kvs), a.config.num_key_value_heads, 0, a.head_dim)
    return stack_padded(kvs, L)

"""transformers building blocks per target architecture (paper Sec. 3: the
drafts are built from the target's own layer types).

`blocks_for(config)` names, per supported architecture, the transformers
classes a draft layer is made of (attention with its q/k norms where the
architecture has them, MLP, RMSNorm, rotary embedding, decoder layer); an
architecture outside `ARCHITECTURES` is refused with one line. Gemma4 targets
get a dense, all-full-attention draft config (`gemma4_draft_config`); with
drafter.layer_arch qwen3, any other target gets a Qwen3 config of its sizes
(`qwen3_draft_config`), so the draft layers are Qwen3's whatever the target.
"""
from __future__ import annotations

import copy
import importlib
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..architectures import ARCHITECTURES, check_model_type, same_layers  # noqa: F401
from ..core.batch_cache import folded_gqa_sdpa


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate one [B, H, L, hd] tensor by cos/sin [B, L, hd]: x cos + rotate_half(x) sin,
    the formula of every architecture here (transformers' per-model
    apply_rotary_pos_emb; its module global is not called, since transformers
    >= 5.25 may replace it by a kernels wrapper of another signature)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` on a (q, k) pair."""
    return rope(q, cos, sin), rope(k, cos, sin)


def blocks_for(config) -> SimpleNamespace:
    """Attention / MLP / RMSNorm / rotary / decoder-layer classes of the target's
    architecture (e.g. Qwen3Attention with its q/k norms). `family` is "gemma4"
    for Gemma4 targets, whose draft layers follow Gemma4 semantics
    (dflash.Gemma4KVInjectionLayer), else "default"; `rope_kwargs` are the
    rotary embedding's extra forward arguments (Gemma4's needs the layer type;
    the drafts are all full attention, as in the reference)."""
    mt = getattr(config, "model_type", None)
    check_model_type(mt)
    module, prefix, norm = ARCHITECTURES[mt]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    ns = SimpleNamespace(**{n: getattr(mod, prefix + n) for n in ("Attention", "MLP", "RotaryEmbedding", "DecoderLayer")})
    ns.RMSNorm = getattr(mod, norm)
    ns.family = "gemma4" if module.startswith("gemma4") else "default"
    ns.rope_kwargs = {"layer_type": "full_attention"} if ns.family == "gemma4" else {}
    return ns


def attention(attn: nn.Module, q, k, v, mask) -> torch.Tensor:
    """transformers' sdpa attention (GQA aware; on CPU with the query heads folded,
    `folded_gqa_sdpa`) with a boolean mask (True = attend) or none (full attention),
    or torch's flex_attention when `mask` is a flex `BlockMask` (the block drafters'
    training pass on CUDA, `flex_attention`); returns [B, Lq, H*hd] before o_proj."""
    if isinstance(mask, BlockMask):
        out = flex_attend(q, k, v, mask, attn.scaling)
    else:
        out, _ = folded_gqa_sdpa(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, is_causal=False)
    return out.reshape(out.shape[0], out.shape[1], -1)


_COMPILED_FLEX: dict = {}
# flex_attention's fused kernels hold a head_dim-wide tile in shared memory; past 256
# they run out of it (pytorch#133254, #143832), e.g. Gemma4's 512-wide full-attention heads
FLEX_MAX_HEAD_DIM = 256


def uses_flex(backend: str, device_type: str, head_dim: int) -> bool:
    """Whether a training pass with attention `backend` ("auto", "flex", "sdpa")
    runs flex_attention: forced by "flex"; under "auto" on CUDA for head_dim up to
    FLEX_MAX_HEAD_DIM, else sdpa with the dense mask."""
    if backend == "auto":
        return device_type == "cuda" and head_dim <= FLEX_MAX_HEAD_DIM
    return backend == "flex"


def flex_attend(q, k, v, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """torch's flex_attention over q [B, H, Lq, hd], k/v [B, Hkv, Lk, hd] with a
    BlockMask (GQA without repeating K/V), [B, Lq, H, hd] like sdpa_attention_forward.
    Compiled on CUDA (flex's fused kernel skips the masked-out blocks; eager flex
    materialises the scores); eager elsewhere, where it runs forward only (CPU,
    torch 2.13). flex_attention is no autocast op: q/k/v are cast to the autocast
    dtype (as sdpa is under autocast), else to q's dtype."""
    dev = q.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
    fn, options = flex_attention, None
    if dev == "cuda":
        fn = _COMPILED_FLEX.setdefault("cuda", torch.compile(flex_attention))
        # Below 128 queries inductor picks its decoding kernel, whose BLOCK_M (the
        # next power of two of queries x GQA group) exceeds the BlockMask's 128-wide
        # blocks past 64 grouped queries: "NoValidChoicesError" (torch 2.11, seen on
        # an H200 with 16 anchors x block 7). Training is no decoding: the main kernel.
        options = {"FORCE_USE_FLEX_ATTENTION": True}
    out = fn(q.to(dt), k.to(dt), v.to(dt), block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
             kernel_options=options)
    return out.transpose(1, 2)


class KVStore:
    """Minimal KV cache with the `update(k, v, layer_idx)` API HF attention calls;
    `crop(n)` keeps the first n key positions."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, k, v, layer_idx, *args, **kwargs):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v

    def length(self, layer_idx: int = 0) -> int:
        return self.k[layer_idx].shape[2] if layer_idx in self.k else 0

    def crop(self, n: int) -> None:
        for i in list(self.k):
            self.k[i] = self.k[i][:, :, :n]
            self.v[i] = self.v[i][:, :, :n]


def stack_padded(kvs, L: int) -> torch.Tensor:
    """Per-request K or V [1, H, n_r, hd] (None: no positions yet) right-padded with
    zeros to [R, H, L, hd] (batched drafter calls mask the padding)."""
    ref = next(t for t in kvs if t is not None)
    out = ref.new_zeros(len(kvs), ref.shape[1], L, ref.shape[3])
    for r, t in enumerate(kvs):
        if t is not None:
            out[r, :, : t.shape[2]] = t[0]
    return out


def gemma4_draft_config(tc, n: int):
    """Draft config for a Gemma4 text config `tc`: n dense full-attention layers.

    Facts from the reference (deepseek-ai/DeepSpec gemma4/config.py and
    modeling.py): every draft layer is "full_attention" and uses the target's
    full-attention geometry, head_dim = global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads K/V heads (keys reused as
    values); no MoE block, no per-layer inputs. transformers keeps the global
    geometry only in `per_layer_config` (keyed by target layer index), so it is
    resolved here and made the draft's homogeneous head_dim / KV heads. The
    draft layers also own their K/V (no KV sharing across layers)."""
    full = tc.per_layer_config["full_attention"]  # the target's full-attention layer config
    d = copy.deepcopy(tc.to_dict())
    d.pop("per_layer_config", None)
    d.update(
        num_hidden_layers=n,
        layer_types=["full_attention"] * n,
        head_dim=full.head_dim,
        num_key_value_heads=full.num_key_value_heads,
        global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads,
        num_kv_shared_layers=0,
        enable_moe_block=False,
        hidden_size_per_layer_input=0,
    )
    return tc.__class__.from_dict(d)


# the fields of a target's text config that size a Qwen3 draft layer (the rest are
# Qwen3's own: q/k RMSNorm per head, no biases, full attention)
QWEN3_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                     "pad_token_id", "bos_token_id", "eos_token_id")


def qwen3_draft_config(tc, n: int):
    """A Qwen3Config with the target text config `tc`'s sizes (hidden, heads, K/V
    heads, head_dim, intermediate, activation, RMS eps, rope parameters, max
    positions, vocabulary) and n full-attention layers: the draft layers of
    drafter.layer_arch qwen3, e.g. over a Llama target (a Llama layer plus Qwen3's
    per-head q/k RMSNorm). Qwen3 layers have no biases, whatever the target's
    (init_from_target then copies the weights only)."""
    from transformers import Qwen3Config

    fields = {k: copy.deepcopy(getattr(tc, k)) for k in QWEN3_SIZE_FIELDS if getattr(tc, k, None) is not None}
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rope = copy.deepcopy(getattr(tc, "rope_parameters", None))
    return Qwen3Config(**fields, head_dim=head_dim, rope_parameters=rope, num_hidden_layers=n,
                       layer_types=["full_attention"] * n, use_sliding_window=False, sliding_window=None,
                       max_window_layers=n, attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False)

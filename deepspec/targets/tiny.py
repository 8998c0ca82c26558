"""The tiny random targets: CPU-sized models of each architecture the paper
presets use (Llama for the ``tiny`` spec, Qwen3, Gemma4 and gemma4_unified for
the rehearsals and tests), with SmolLM2's tokenizer or a 512-token vocabulary
of their own. Deterministic: each architecture has a fixed init seed."""
from __future__ import annotations

import torch

from ..errors import DeepSpecError

# Tiny random targets with SmolLM2's tokenizer, by spec: their architecture for
# `build_tiny` (``tiny-qwen3`` and ``tiny-gemma4-unified`` stand in for the paper
# targets' architectures in the CPU rehearsals).
TINY_SPECS = {"tiny": "llama", "tiny-qwen3": "qwen3", "tiny-gemma4-unified": "gemma4_unified", "tiny-qwen3-hd32": "qwen3"}
# what a spec changes in its architecture's tiny config: ``tiny-qwen3-hd32`` has head_dim 32,
# the smallest vLLM's CPU attention has kernels for (the engine tests serve it in vLLM)
TINY_SPEC_OVERRIDES = {"tiny-qwen3-hd32": {"head_dim": 32}}
# Tiny target: 2 layers, hidden 64, real tokenizer. A larger init scale than
# HF's default and a scaled final norm make its next-token distributions
# peaked rather than uniform, so drafters have something to learn in tests.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.2,
)
TINY_SEED = 1234
TINY_FINAL_NORM_SCALE = 4.0

# Tiny Gemma4 model (tests only; the gemma4-12b preset's architecture): the tiny
# target's widths with 4 layers (sliding, full, sliding, full), its own 512-token
# vocabulary and no tokenizer; full-attention layers have a wider head
# (global_head_dim), one K/V head (num_global_key_value_heads) and reuse keys as
# values (attention_k_eq_v). A smaller init scale keeps greedy continuations varied.
TINY_GEMMA4_CONFIG = dict(
    TINY_CONFIG, num_hidden_layers=4, rms_norm_eps=1e-6, initializer_range=0.05,
    vocab_size=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=8, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
)
TINY_GEMMA4_SEED = 0
# The same decoder as transformers' gemma4_unified_text (google/gemma-4-12B-it's text
# model, which has no per-layer inputs or MoE block).
TINY_GEMMA4_UNIFIED_CONFIG = {k: v for k, v in TINY_GEMMA4_CONFIG.items() if k != "hidden_size_per_layer_input"}

# Tiny Qwen3 model (tests only; the qwen3-* presets' architecture, q/k RMSNorm per
# head): the tiny target's widths with 3 layers, head_dim 16, untied head, its own
# 512-token vocabulary and no tokenizer.
TINY_QWEN3_CONFIG = dict(
    TINY_CONFIG, num_hidden_layers=3, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-6,
    vocab_size=512, pad_token_id=0, eos_token_id=1, bos_token_id=2, rope_theta=1000000.0,
)
TINY_QWEN3_SEED = 7


def tiny_config(arch: str = "llama", tokenizer=None, **overrides):
    """The config of a tiny random model: ``llama`` (the ``tiny`` spec; vocabulary
    and special ids from `tokenizer`), ``gemma4`` (a Gemma4TextConfig), ``gemma4_unified``
    (a Gemma4UnifiedTextConfig, the gemma4-12b target's text model) or ``qwen3``."""
    if arch == "llama":
        from transformers import LlamaConfig as config_cls

        base = TINY_CONFIG
    elif arch == "gemma4":
        from transformers import Gemma4TextConfig as config_cls

        base = TINY_GEMMA4_CONFIG
    elif arch == "gemma4_unified":
        from transformers import Gemma4UnifiedTextConfig as config_cls

        base = TINY_GEMMA4_UNIFIED_CONFIG
    elif arch == "qwen3":
        from transformers import Qwen3Config as config_cls

        base = TINY_QWEN3_CONFIG
    else:
        raise DeepSpecError(f"unknown tiny architecture {arch!r}: use llama, gemma4, gemma4_unified or qwen3")
    if tokenizer is not None:
        base = dict(base, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return config_cls(**{**base, **overrides})


def build_tiny(arch: str = "llama", tokenizer=None, *, multimodal: bool = False, **overrides):
    """A tiny random model (`tiny_config`), initialised from the architecture's
    fixed seed, with a sharpened output. `multimodal` wraps the Gemma4 decoder
    in Gemma4ForConditionalGeneration (text only), the hub checkpoints' layout."""
    import transformers

    cfg = tiny_config(arch, tokenizer, **overrides)
    if multimodal:
        if arch != "gemma4":
            raise DeepSpecError("build_tiny: multimodal=True needs arch='gemma4'")
        cfg = transformers.Gemma4Config(text_config=cfg.to_dict(), vision_config=None, audio_config=None)
        model_cls = transformers.Gemma4ForConditionalGeneration
    else:
        model_cls = {"gemma4": transformers.Gemma4ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                     "gemma4_unified": transformers.Gemma4UnifiedForCausalLM}.get(arch, transformers.LlamaForCausalLM)
    with torch.random.fork_rng():
        torch.manual_seed({"gemma4": TINY_GEMMA4_SEED, "gemma4_unified": TINY_GEMMA4_SEED,
                           "qwen3": TINY_QWEN3_SEED}.get(arch, TINY_SEED))
        model = model_cls(cfg)
    with torch.no_grad():  # sharpen the output: entropy ~2 nats instead of ~9.5 (Llama)
        model.get_decoder().norm.weight.fill_(TINY_FINAL_NORM_SCALE)
    if tokenizer is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model

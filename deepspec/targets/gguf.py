"""A llama-architecture GGUF file (the offline SmolLM2 target) as a transformers
Llama checkpoint, read with the `gguf` package in one pass.

transformers can load a GGUF itself (`from_pretrained(..., gguf_file=...)`), but
it parses the file twice (config, then weights) and de-quantizes through torch,
~13 s for SmolLM2-135M on one core against ~4 s here (most of it the reader's parse of
the tokenizer's 49 k tokens): the conversion is on the critical path of every first run. The result is the same model bit for bit
(tests/test_target.py compares the two: every tensor equal, the same config).

GGUF stores a llama model's q/k projections with the rows of each head
interleaved for llama.cpp's rotary embedding (the two halves of a head's
dimensions alternate); `_unpermute` puts them back in transformers' order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DeepSpecError

# GGUF tensor name (blk.<layer>.<name>.weight) -> transformers parameter name
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (d/2, 2) -> (2, d/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise DeepSpecError(f"GGUF tensor {gguf_name!r} has no transformers Llama counterpart")


def read_llama_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """(LlamaConfig, state dict) of the llama-architecture GGUF at `path`, de-quantized to `dtype`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import LlamaConfig

    reader = GGUFReader(str(path))

    def meta(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise DeepSpecError(f"{path}: GGUF metadata key {key!r} missing")
            return default
        return field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise DeepSpecError(f"{path}: GGUF architecture {arch!r}, this converter reads llama")
    n_head, n_kv = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))
    hidden = int(meta("llama.embedding_length"))
    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        state[_hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(dtype)  # a copy: the file is mapped read-only
    token_id = {k: int(meta(f"tokenizer.ggml.{g}_token_id", -1)) for k, g in
                [("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"), ("unk_token_id", "unknown")]}
    config = LlamaConfig(
        vocab_size=int(meta("llama.vocab_size", state["model.embed_tokens.weight"].shape[0])),
        hidden_size=hidden,
        intermediate_size=int(meta("llama.feed_forward_length")),
        num_hidden_layers=int(meta("llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=hidden // n_head,
        max_position_embeddings=int(meta("llama.context_length")),
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_theta": float(meta("llama.rope.freq_base", 10000.0)), "rope_type": "default"},
        tie_word_embeddings="lm_head.weight" not in state,
        **{k: v for k, v in token_id.items() if v >= 0},
    )
    return config, state

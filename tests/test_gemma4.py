"""Gemma4-only checks on the tiny random Gemma4 target (conftest.py `gemma4_target`,
built by deepspec.targets.tiny.build_tiny("gemma4"): the gemma4-12b preset's architecture).

The target is transformers' Gemma4ForCausalLM with the real Gemma 4 structure:
sliding and full attention layers (the last one full), a wider head
(global_head_dim) and fewer K/V heads (num_global_key_value_heads) on
full-attention layers, keys reused as values there (attention_k_eq_v),
final-logit soft-capping and the sqrt(d)-scaled embedding. The hub checkpoints
load as the multimodal Gemma4ForConditionalGeneration, covered by the last test.

The drafter tests that hold for any target (train/inference agreement, KV cache,
a training step, save/load, reduced vocabulary, init_from_target) run on this
target too, through the `target_kind` parametrization of tests/test_drafters.py.
Here: the Gemma4 building blocks and draft config, the DFlash/DSpark injection
layer against transformers' Gemma4 decoder layer, init_from_target across
sliding and full source layers, greedy speculative decoding == plain greedy
decoding past the sliding window (after a short fit, so drafts get accepted),
and the multimodal wrapper (conftest.py `gemma4_wrapped_target`).
"""
import copy

import pytest
import torch
from transformers import Gemma4TextConfig, LlamaConfig
from transformers.models.gemma4 import modeling_gemma4 as g4
from transformers.models.llama import modeling_llama

from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.drafters import build_drafter
from deepspec.drafters.blocks import blocks_for, gemma4_draft_config
from deepspec.drafters.dflash import Gemma4KVInjectionLayer
from deepspec.drafters.eagle3 import Gemma4Eagle3Layer
from deepspec.targets.tiny import tiny_config
from deepspec.training.run import step_spec

SEQ = [2, 17, 300, 45, 9, 230, 77, 410, 5, 61, 128, 333, 12, 90, 499, 3]
PROMPT = [5, 6, 7, 8]


def _cfg(cfg, **drafter):
    c = copy.deepcopy(cfg)
    c["drafter"].update(drafter)
    return c


def _drafter(method, target, cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return build_drafter(method, target, _cfg(cfg, **kw)).eval()


def _batch(target, cfg, ids):
    ids = torch.as_tensor(ids).view(1, -1)
    feats, last = target.features(ids, cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    return dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)


# --------------------------------------------------------------------------- building blocks


def test_blocks_for_finds_gemma4_classes(gemma4_target):
    b = blocks_for(gemma4_target.config)
    assert (b.Attention, b.MLP, b.RMSNorm, b.RotaryEmbedding, b.DecoderLayer) == (
        g4.Gemma4TextAttention, g4.Gemma4TextMLP, g4.Gemma4RMSNorm, g4.Gemma4TextRotaryEmbedding,
        g4.Gemma4TextDecoderLayer,
    )
    assert b.family == "gemma4" and b.rope_kwargs == {"layer_type": "full_attention"}
    llama = blocks_for(LlamaConfig())
    assert llama.family == "default" and llama.RMSNorm is modeling_llama.LlamaRMSNorm


def test_our_rope_is_transformers_rope():
    """blocks.rope / apply_rope compute transformers' own apply_rotary_pos_emb
    (Llama/Qwen3 rotate a q/k pair, Gemma4 one tensor), whatever wraps it."""
    from transformers.models.qwen3 import modeling_qwen3

    from deepspec.drafters.blocks import apply_rope, rope
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    for hf in (modeling_llama.apply_rotary_pos_emb, modeling_qwen3.apply_rotary_pos_emb):
        for ours, theirs in zip(apply_rope(q, k, cos, sin), hf(q, k, cos, sin)):
            assert torch.equal(ours, theirs)
    assert torch.equal(rope(q, cos, sin), g4.apply_rotary_pos_emb(q, cos, sin))


def test_draft_config_uses_full_attention_geometry(gemma4_target, gemma4_cfg):
    """Reference: every draft layer is full attention with global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads (no v_proj)."""
    d = _drafter("dspark", gemma4_target, gemma4_cfg)
    c = d.config
    assert c.layer_types == ["full_attention"] * c.num_hidden_layers
    assert c.head_dim == 32 and c.num_key_value_heads == 1 and c.final_logit_softcapping == 30.0
    for layer in d.layers:
        a = layer.self_attn
        assert isinstance(layer, Gemma4KVInjectionLayer) and isinstance(a, g4.Gemma4TextAttention)
        assert a.head_dim == 32 and a.k_proj.out_features == 32 and a.v_proj is None and a.scaling == 1.0
        assert not a.v_norm.with_scale
    assert d._shared.softcap == 30.0


def test_draft_vocab_target_probs_soft_capped(gemma4_target, gemma4_cfg):
    """The target's log-normalizer soft-caps the logits as p_t does: p_t on a reduced
    draft vocabulary from its K logits and the normalizer equals the capped full softmax."""
    cfg = {**gemma4_cfg, "drafter": {**gemma4_cfg["drafter"], "draft_vocab_size": 128}}
    d = build_drafter("dspark", gemma4_target, cfg, token_counts=torch.arange(gemma4_target.vocab_size, 0, -1))
    x = 4.0 * torch.randn(3, 5, gemma4_target.hidden_size, generator=torch.Generator().manual_seed(0))
    want_pt, want_out = d.restrict_to_draft_vocab(d.target_probs(x))
    pt, out = d.draft_vocab_target_probs(x, gemma4_target.log_normalizer(x))
    assert torch.allclose(pt, want_pt, rtol=1e-5, atol=1e-8) and torch.allclose(out, want_out, atol=1e-5)
    raw = torch.logsumexp(gemma4_target.lm_head(x).float(), -1)
    assert not torch.allclose(gemma4_target.log_normalizer(x), raw, atol=1e-3)  # the cap is applied


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_drafter_layers_are_gemma4_layers(gemma4_target, gemma4_cfg, method):
    """Eagle3 uses DeepSeek's Gemma4 Eagle3 layer (transformers' Gemma4 attention with
    2d-wide q/k projections), DFlash/DSpark the injection layer; the draft config is a
    Gemma4TextConfig (save/load: test_drafters.py)."""
    d = _drafter(method, gemma4_target, gemma4_cfg)
    layer_cls = Gemma4Eagle3Layer if method == "eagle3" else Gemma4KVInjectionLayer
    assert all(type(layer) is layer_cls for layer in d.layers)
    if method == "eagle3":
        a = d.layers[0].self_attn
        assert type(a) is g4.Gemma4TextAttention and a.v_proj is None  # keys as values (attention_k_eq_v)
        assert a.q_proj.in_features == 2 * d.config.hidden_size == a.k_proj.in_features
    assert isinstance(d.config, Gemma4TextConfig) and d.config.head_dim == 32


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_injection_layer_equals_gemma4_decoder_layer(k_eq_v):
    """Without injected context and with a full mask, the injection layer is
    transformers' Gemma4 decoder layer (same parameter names, same weights)."""
    cfg = gemma4_draft_config(tiny_config("gemma4", attention_k_eq_v=k_eq_v), 1)
    cfg._attn_implementation = "sdpa"
    blocks = blocks_for(cfg)
    torch.manual_seed(0)
    ours = Gemma4KVInjectionLayer(cfg, 0, blocks)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)  # norms away from 1
        ours.layer_scalar.fill_(0.7)
    ref = g4.Gemma4TextDecoderLayer(cfg, 0)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert (ours.self_attn.v_proj is None) == k_eq_v
    x = torch.randn(2, 6, cfg.hidden_size)
    pos = torch.arange(6).expand(2, 6)
    rot = blocks.RotaryEmbedding(config=cfg)
    cos, sin = rot(x, pos, **blocks.rope_kwargs)
    empty = x.new_zeros(2, cfg.num_key_value_heads, 0, cfg.head_dim)
    with torch.no_grad():
        a = ours(x, empty, empty, cos, sin, None)
        b = ref(x, position_embeddings=(cos, sin), attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool),
                shared_kv_states={})
    assert torch.allclose(a, b, atol=1e-5)


def test_init_from_target_copies_matching_tensors(gemma4_target, gemma4_cfg):
    """Draft layer i <- target layer L-k+i; a sliding source layer has a narrower
    attention, so only its MLP and norms are copied."""
    c = _cfg(gemma4_cfg, init_from_target=True)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 2, "dspark": 2}
    d = build_drafter("dspark", gemma4_target, c)
    tl = gemma4_target.model.get_decoder().layers  # [sliding, full, sliding, full]
    assert torch.equal(d.layers[1].self_attn.q_proj.weight, tl[3].self_attn.q_proj.weight)
    assert torch.equal(d.layers[0].mlp.down_proj.weight, tl[2].mlp.down_proj.weight)
    assert torch.equal(d.layers[0].post_feedforward_layernorm.weight, tl[2].post_feedforward_layernorm.weight)
    assert d.layers[0].self_attn.q_proj.weight.shape != tl[2].self_attn.q_proj.weight.shape


# --------------------------------------------------------------------------- decoding

N_NEW = 16  # prompt + 16 tokens: well past the sliding window (8)


@pytest.fixture(scope="module")
def plain_tokens(gemma4_target):
    return plain_generate(gemma4_target, PROMPT, max_new_tokens=N_NEW, temperature=0.0).tokens


def _fit(d, target, cfg, seq, n_prompt, steps, lr):
    """A short fit on the target's own greedy continuation `seq` of a prompt, so
    that greedy decoding accepts some drafts (3 steps already do here)."""
    batch = _batch(target, cfg, seq)
    batch["loss_mask"][:, : n_prompt - 1] = False
    c = copy.deepcopy(cfg)
    c["train"]["num_anchors"] = 16
    opt = torch.optim.AdamW(d.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    d.train()
    for _ in range(steps):
        loss, _ = d.training_step(batch, step_spec(c), gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_greedy_speculative_equals_plain(gemma4_target, gemma4_cfg, plain_tokens, method):
    d = _fit(_drafter(method, gemma4_target, gemma4_cfg), gemma4_target, gemma4_cfg, PROMPT + plain_tokens,
             len(PROMPT), steps=8, lr=2e-2)
    gen = speculative_generate(gemma4_target, d, PROMPT, feature_layers=gemma4_cfg["target"]["feature_layers"],
                               max_new_tokens=N_NEW, temperature=0.0)
    assert gen.tokens == plain_tokens
    assert sum(r["accepted"] for r in gen.rounds) > 0  # the accepted-draft path is exercised
    assert max(r["proposal_len"] for r in gen.rounds) == 7


# --------------------------------------------------------------------------- multimodal wrapper


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_multimodal_wrapper_target(gemma4_wrapped_target, gemma4_cfg, method):
    t = gemma4_wrapped_target
    assert t.num_layers == 4 and t.hidden_size == 64 and t.vocab_size == 512
    c = _cfg(gemma4_cfg, init_from_target=True)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 1, "dspark": 1}
    d = _drafter(method, t, c)
    assert isinstance(d.config, Gemma4TextConfig) and d._shared.softcap == 30.0
    src = t.model.get_decoder().layers[-1]
    if method == "eagle3":  # 2d-wide q/k/v: only the MLP and norms come from the target
        assert torch.equal(d.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)
    else:
        assert torch.equal(d.layers[0].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    d.train()
    loss, _ = d.training_step(_batch(t, c, SEQ), step_spec(c), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    d.eval()
    plain = plain_generate(t, PROMPT, max_new_tokens=12, temperature=0.0).tokens
    gen = speculative_generate(t, d, PROMPT, feature_layers=c["target"]["feature_layers"], max_new_tokens=12,
                               temperature=0.0)
    assert gen.tokens == plain

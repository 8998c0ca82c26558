"""Drafters on a tiny random Gemma4 target (the gemma4-12b preset's architecture).

The target is transformers' Gemma4ForCausalLM built from a Gemma4TextConfig with
the real Gemma 4 structure: sliding and full attention layers (the last one full),
a wider head (global_head_dim) and fewer K/V heads (num_global_key_value_heads)
on full-attention layers, keys reused as values there (attention_k_eq_v),
final-logit soft-capping and the sqrt(d)-scaled embedding. The hub checkpoints
load as the multimodal Gemma4ForConditionalGeneration, covered by the last tests.

Checked per drafter: the Gemma4 building blocks and draft config, the DFlash/DSpark
injection layer against transformers' Gemma4 decoder layer, a training step,
save/load, training forward vs incremental `propose`, and greedy speculative
decoding == plain greedy decoding (after a short fit, so drafts get accepted).
"""
import copy

import pytest
import torch
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    LlamaConfig,
)
from transformers.models.gemma4 import modeling_gemma4 as g4
from transformers.models.llama import modeling_llama

from deepspec.decode import plain_generate, speculative_generate
from deepspec.drafters import build_drafter, load_drafter
from deepspec.drafters.common import blocks_for, gemma4_draft_config
from deepspec.drafters.dflash import Gemma4KVInjectionLayer
from deepspec.losses import training_step
from deepspec.targets import Target, eos_ids_of

# 4 layers (sliding, full, sliding, full), hidden 64, vocab 512. A smaller init
# scale than the Llama tiny target's (0.2) keeps greedy continuations varied.
TINY_GEMMA4_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=8,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    initializer_range=0.05,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
TINY_GEMMA4_SEED = 0
FEATURE_LAYERS = [0, 1, 2]  # sliding, full, sliding (the final layer is not allowed)
SEQ = [2, 17, 300, 45, 9, 230, 77, 410, 5, 61, 128, 333, 12, 90, 499, 3]
PROMPT = [5, 6, 7, 8]


def _text_config(**kw) -> Gemma4TextConfig:
    return Gemma4TextConfig(**{**TINY_GEMMA4_CONFIG, **kw})


def _as_target(model, target_id="tiny-gemma4") -> Target:
    with torch.no_grad():  # sharpen the output, as for the tiny Llama target
        model.get_decoder().norm.weight.fill_(4.0)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id=target_id, eos_token_ids=eos_ids_of(model, None))


@pytest.fixture(scope="module")
def g4_target() -> Target:
    with torch.random.fork_rng():
        torch.manual_seed(TINY_GEMMA4_SEED)
        return _as_target(Gemma4ForCausalLM(_text_config()))


@pytest.fixture(scope="module")
def g4_cfg(tiny_cfg) -> dict:
    c = copy.deepcopy(tiny_cfg)
    c["target"]["feature_layers"] = FEATURE_LAYERS
    return c


def _cfg(cfg, **drafter):
    c = copy.deepcopy(cfg)
    c["drafter"].update(drafter)
    return c


def _drafter(method, target, cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return build_drafter(method, target, _cfg(cfg, **kw)).eval()


def _batch(target, ids):
    ids = torch.as_tensor(ids).view(1, -1)
    feats, last = target.features(ids, FEATURE_LAYERS)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    return dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)


@pytest.fixture(scope="module")
def seq_batch(g4_target):
    return _batch(g4_target, SEQ)


# --------------------------------------------------------------------------- building blocks


def test_blocks_for_finds_gemma4_classes(g4_target):
    b = blocks_for(g4_target.config)
    assert (b.Attention, b.MLP, b.RMSNorm, b.RotaryEmbedding, b.DecoderLayer) == (
        g4.Gemma4TextAttention, g4.Gemma4TextMLP, g4.Gemma4RMSNorm, g4.Gemma4TextRotaryEmbedding,
        g4.Gemma4TextDecoderLayer,
    )
    assert b.family == "gemma4" and b.rope_kwargs == {"layer_type": "full_attention"}
    llama = blocks_for(LlamaConfig())
    assert llama.family == "default" and llama.RMSNorm is modeling_llama.LlamaRMSNorm
    assert llama.apply_rotary_pos_emb is modeling_llama.apply_rotary_pos_emb


def test_draft_config_uses_full_attention_geometry(g4_target, g4_cfg):
    """Reference: every draft layer is full attention with global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads (no v_proj)."""
    d = _drafter("dspark", g4_target, g4_cfg)
    c = d.config
    assert c.layer_types == ["full_attention"] * c.num_hidden_layers
    assert c.head_dim == 32 and c.num_key_value_heads == 1 and c.final_logit_softcapping == 30.0
    for layer in d.layers:
        a = layer.self_attn
        assert isinstance(layer, Gemma4KVInjectionLayer) and isinstance(a, g4.Gemma4TextAttention)
        assert a.head_dim == 32 and a.k_proj.out_features == 32 and a.v_proj is None and a.scaling == 1.0
        assert not a.v_norm.with_scale
    assert d._shared.softcap == 30.0


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_injection_layer_equals_gemma4_decoder_layer(k_eq_v):
    """Without injected context and with a full mask, the injection layer is
    transformers' Gemma4 decoder layer (same parameter names, same weights)."""
    cfg = gemma4_draft_config(_text_config(attention_k_eq_v=k_eq_v), 1)
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


# --------------------------------------------------------------------------- training, save/load


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_training_step_and_save_load(g4_target, g4_cfg, seq_batch, tmp_path, method):
    d = _drafter(method, g4_target, g4_cfg)
    layer_cls = g4.Gemma4TextDecoderLayer if method == "eagle3" else Gemma4KVInjectionLayer
    assert all(type(layer) is layer_cls for layer in d.layers)
    d.train()
    loss, m = training_step(d, seq_batch, _cfg(g4_cfg), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and 0.0 <= m["c_star_1"] <= 1.0
    loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".self_attn." in n)
    d.eval()
    d.save_pretrained(tmp_path / method)
    e = load_drafter(tmp_path / method, g4_target)
    assert type(e) is type(d) and isinstance(e.config, Gemma4TextConfig)
    assert e.config.layer_types == d.config.layer_types and e.config.head_dim == 32
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    with torch.no_grad():
        if method == "eagle3":
            a, b = d(ids, f, steps=2)[-1], e(ids, f, steps=2)[-1]
        else:
            an = torch.tensor([[4, 9]])
            a, b = d(ids, f, an), e(ids, f, an)
        assert torch.equal(d.draft_logits(a), e.draft_logits(b))


def test_init_from_target_copies_matching_tensors(g4_target, g4_cfg):
    """Draft layer i <- target layer L-k+i; a sliding source layer has a narrower
    attention, so only its MLP and norms are copied."""
    c = _cfg(g4_cfg, init_from_target=True)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 2, "dspark": 2}
    d = build_drafter("dspark", g4_target, c)
    tl = g4_target.model.get_decoder().layers  # [sliding, full, sliding, full]
    assert torch.equal(d.layers[1].self_attn.q_proj.weight, tl[3].self_attn.q_proj.weight)
    assert torch.equal(d.layers[0].mlp.down_proj.weight, tl[2].mlp.down_proj.weight)
    assert torch.equal(d.layers[0].post_feedforward_layernorm.weight, tl[2].post_feedforward_layernorm.weight)
    assert d.layers[0].self_attn.q_proj.weight.shape != tl[2].self_attn.q_proj.weight.shape


# --------------------------------------------------------------------------- train/inference agreement


def test_block_sees_only_earlier_context(g4_target, g4_cfg, seq_batch):
    d = _drafter("dspark", g4_target, g4_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    p = 8
    anchors = torch.tensor([[p, 11]])
    with torch.no_grad():
        h0 = d(ids, f, anchors)
        f_late = f.clone()
        f_late[:, p:] += torch.randn_like(f_late[:, p:]) * 5
        h1 = d(ids, f_late, anchors)
    assert torch.allclose(h0[:, 0], h1[:, 0], atol=1e-5)
    assert not torch.allclose(h0[:, 1], h1[:, 1], atol=1e-3)


@pytest.mark.parametrize("method,kw", [("dflash", {}), ("dspark", {}), ("dspark", {"markov_head_type": "rnn"})])
def test_propose_matches_training_forward(g4_target, g4_cfg, seq_batch, method, kw):
    d = _drafter(method, g4_target, g4_cfg, **kw)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    st = d.init_state()
    d.propose(st, f[:, :5], ids[:, :6], temperature=1.0, generator=torch.Generator().manual_seed(0))
    P = 9  # second call: positions 5..8 verified, anchor at 9
    prop = d.propose(st, f[:, 5:P], ids[:, 5 : P + 1], temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert st.n == P and prop.probs.shape == (1, d.gamma, g4_target.vocab_size)
    with torch.no_grad():
        h = d(ids, f, torch.tensor([[P]]))[0]
        prev = torch.cat([ids[:, P : P + 1], prop.tokens[:, :-1]], 1)
        ref = torch.softmax(d.block_logits(h, prev), -1)
        conf = d.confidence_logits(h, prev)
    assert torch.allclose(prop.probs, ref, atol=1e-5)
    if method == "dspark":
        assert torch.allclose(prop.conf_logits, conf, atol=1e-5)
    else:
        assert prop.conf_logits is None


def test_eagle3_chain_cache_equals_recompute(g4_target, g4_cfg, seq_batch):
    d = _drafter("eagle3", g4_target, g4_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    st = d.init_state()
    d.propose(st, f[:, :4], ids[:, :5], temperature=0.0)
    P = 8
    prop = d.propose(st, f[:, 4:P], ids[:, 4 : P + 1], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert st.n == P and st.cache.length() == P
    seq = torch.cat([ids[:, : P + 1], prop.tokens], 1)
    feats = torch.cat([f[:, :P], torch.zeros(1, seq.shape[1] - P, f.shape[-1])], 1)
    with torch.no_grad():
        outs = d(seq, feats)
        ref = torch.stack([torch.softmax(d.draft_logits(o[:, P - 1]), -1) for o in outs], 1)
    assert torch.allclose(prop.probs, ref, atol=1e-5)


# --------------------------------------------------------------------------- decoding


def _fit(d, target, cfg, prompt, n_new, steps, lr):
    """A short fit on the target's own greedy continuation of `prompt`, so that
    greedy decoding accepts some drafts."""
    seq = prompt + plain_generate(target, prompt, max_new_tokens=n_new, temperature=0.0).tokens
    batch = _batch(target, seq)
    batch["loss_mask"][:, : len(prompt) - 1] = False
    c = copy.deepcopy(cfg)
    c["train"]["num_anchors"] = 32
    opt = torch.optim.AdamW(d.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    d.train()
    for _ in range(steps):
        loss, _ = training_step(d, batch, c, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_greedy_speculative_equals_plain(g4_target, g4_cfg, method):
    n_new = 24  # prompt + 24 tokens: well past the sliding window (8)
    d = _fit(_drafter(method, g4_target, g4_cfg), g4_target, g4_cfg, PROMPT, n_new, steps=40, lr=1e-2)
    plain = plain_generate(g4_target, PROMPT, max_new_tokens=n_new, temperature=0.0).tokens
    gen = speculative_generate(g4_target, d, PROMPT, feature_layers=FEATURE_LAYERS, max_new_tokens=n_new,
                               temperature=0.0)
    assert gen.tokens == plain
    assert sum(r["accepted"] for r in gen.rounds) > 0  # the accepted-draft path is exercised
    assert max(r["proposal_len"] for r in gen.rounds) == 7


# --------------------------------------------------------------------------- multimodal wrapper


@pytest.fixture(scope="module")
def g4_wrapped_target() -> Target:
    """The hub layout: Gemma4ForConditionalGeneration (text only) around the same decoder."""
    with torch.random.fork_rng():
        torch.manual_seed(TINY_GEMMA4_SEED)
        cfg = Gemma4Config(text_config=_text_config().to_dict(), vision_config=None, audio_config=None)
        return _as_target(Gemma4ForConditionalGeneration(cfg), target_id="tiny-gemma4-mm")


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_multimodal_wrapper_target(g4_wrapped_target, g4_cfg, method):
    t = g4_wrapped_target
    assert t.num_layers == 4 and t.hidden_size == 64 and t.vocab_size == 512
    c = _cfg(g4_cfg, init_from_target=True)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 1, "dspark": 1}
    d = _drafter(method, t, c)
    assert isinstance(d.config, Gemma4TextConfig) and d._shared.softcap == 30.0
    assert torch.equal(d.layers[0].self_attn.q_proj.weight, t.model.get_decoder().layers[-1].self_attn.q_proj.weight)
    d.train()
    loss, _ = training_step(d, _batch(t, SEQ), c, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    d.eval()
    plain = plain_generate(t, PROMPT, max_new_tokens=12, temperature=0.0).tokens
    gen = speculative_generate(t, d, PROMPT, feature_layers=FEATURE_LAYERS, max_new_tokens=12, temperature=0.0)
    assert gen.tokens == plain

"""Eagle3 = the standard EAGLE-3 layer, and its loss as DeepSeek's reference computes it.

* The drafter's TTT forward equals a short plain-torch re-derivation of the
  equations (residual = g; x = [input_layernorm(emb); hidden_norm(g)]; 2d-wide
  q/k/v; h = g + attn(x); post-attention norm, MLP, residual; g = fc(features)
  at step 0, the draft's pre-norm output afterwards), on the tiny Llama, Qwen3
  (q/k norms) and Gemma4 (sandwich norms, value norm, keys as values,
  layer_scalar) targets, with random weights. Only the RoPE tables come from
  the drafter's rotary embedding (transformers').
* The loss rules (row mask, normaliser) against a direct transcription of the
  reference's construction, and the loss of a whole step against a plain sum.
* Greedy speculative decoding with the new Eagle3 equals plain decoding (Qwen3).
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.losses import chain_normalizer, chain_row_mask
from deepspec.drafters import build_drafter
from deepspec.training.loop import step_spec

SEQ = [5, 9, 3, 500, 17, 92, 441, 60, 7, 311, 299, 12]


def _cfg(cfg, **loss):
    c = copy.deepcopy(cfg)
    c["loss"].update(loss)
    return c


@pytest.fixture(scope="module", params=["tiny", "qwen3", "gemma4"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def tc(kind, request):
    """(target, cfg) of each tiny architecture."""
    name = {"tiny": ("tiny_target", "tiny_cfg"), "qwen3": ("qwen3_target", "qwen3_cfg"),
            "gemma4": ("gemma4_target", "gemma4_cfg")}[kind]
    return request.getfixturevalue(name[0]), request.getfixturevalue(name[1])


def _randomize(d, seed=0):
    """Random weights everywhere (norm scales away from 1, layer_scalar != 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            base = 1.0 if p.dim() == 1 else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g) / (1 if p.dim() == 1 else math.sqrt(p.shape[-1])))
        for name, b in d.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.7)
    return d


# --------------------------------------------------------------------------- plain-torch equations


def rms(x, w=None, eps=1e-6):
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def rot(x, cos, sin):  # x [B, H, L, hd], cos/sin [B, L, hd]
    x1, x2 = x.chunk(2, -1)
    return x * cos.unsqueeze(1) + torch.cat([-x2, x1], -1) * sin.unsqueeze(1)


def heads(x, n):  # [B, L, n*hd] -> [B, n, L, hd]
    B, L, _ = x.shape
    return x.view(B, L, n, -1).transpose(1, 2)


def plain_layer(W, p, e, g, cos, sin, keys, vals, allowed, arch, cfg):
    """One standard EAGLE-3 layer on rows; keys/vals: lists of earlier steps' [B,Hkv,L,hd]."""
    eps = cfg.rms_norm_eps
    x = torch.cat([rms(e, W[p + "input_layernorm.weight"], eps), rms(g, W[p + "hidden_norm.weight"], eps)], -1)
    H = cfg.num_attention_heads
    q = heads(x @ W[p + "self_attn.q_proj.weight"].T, H)
    kr = x @ W[p + "self_attn.k_proj.weight"].T
    Hkv = kr.shape[-1] // q.shape[-1]
    k = heads(kr, Hkv)
    v = heads(x @ W[p + "self_attn.v_proj.weight"].T, Hkv) if p + "self_attn.v_proj.weight" in W else k
    if arch in ("qwen3", "gemma4"):
        q, k = rms(q, W[p + "self_attn.q_norm.weight"], eps), rms(k, W[p + "self_attn.k_norm.weight"], eps)
    if arch == "gemma4":
        v = rms(v, None, eps)
    keys.append(rot(k, cos, sin))
    vals.append(v)
    K, V = torch.cat(keys, 2), torch.cat(vals, 2)
    K, V = K.repeat_interleave(H // Hkv, 1), V.repeat_interleave(H // Hkv, 1)
    scale = 1.0 if arch == "gemma4" else q.shape[-1] ** -0.5
    scores = (rot(q, cos, sin) @ K.transpose(-1, -2)) * scale
    a = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ V
    o = a.transpose(1, 2).reshape(g.shape[0], g.shape[1], -1) @ W[p + "self_attn.o_proj.weight"].T
    act = F.gelu if arch == "gemma4" else F.silu
    kw = {"approximate": "tanh"} if arch == "gemma4" else {}

    def mlp(h):
        return (act(h @ W[p + "mlp.gate_proj.weight"].T, **kw) * (h @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T

    if arch != "gemma4":
        h = g + o
        return h + mlp(rms(h, W[p + "post_attention_layernorm.weight"], eps))
    h = g + rms(o, W[p + "post_attention_layernorm.weight"], eps)
    h = h + rms(mlp(rms(h, W[p + "pre_feedforward_layernorm.weight"], eps)), W[p + "post_feedforward_layernorm.weight"], eps)
    return h * W[p + "layer_scalar"]


def plain_ttt(d, W, ids, feats, steps, arch, embed):
    """The TTT forward from the equations: post-norm outputs per step."""
    B, L = ids.shape
    cfg = d.config
    t = torch.arange(L)
    g = feats @ W["fc.weight"].T
    n_layers = cfg.num_hidden_layers
    keys, vals = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    outs = []
    for s in range(steps):
        e = embed(ids[:, (t + 1 + s).clamp(max=L - 1)])
        cos, sin = d.rotary(g, (t + s).expand(B, L))
        # row t sees step-0 keys j <= t and its own row in steps 1..s
        allowed = torch.cat([torch.ones(L, L).tril().bool()] + [torch.eye(L).bool()] * s, 1)
        for i in range(n_layers):
            g = plain_layer(W, f"layers.{i}.", e, g, cos, sin, keys[i], vals[i], allowed, arch, cfg)
        outs.append(rms(g, W["norm.weight"], cfg.rms_norm_eps))
    return outs


def test_ttt_forward_equals_plain_equations(kind, tc):
    target, cfg = tc
    c = copy.deepcopy(cfg)
    c["drafter"]["num_layers"] = {"eagle3": 2}
    torch.manual_seed(0)
    d = _randomize(build_drafter("eagle3", target, c).eval())
    ids = torch.tensor([SEQ]) % target.vocab_size
    feats, _ = target.features(ids, c["target"]["feature_layers"])
    W = {k: v.detach() for k, v in d.state_dict().items()}
    with torch.no_grad():
        ours = d(ids, feats, steps=3)
        ref = plain_ttt(d, W, ids, feats, 3, kind, target.embed_tokens)
    for s, (a, b) in enumerate(zip(ours, ref)):
        assert (a - b).abs().max() < 2e-4 * max(1.0, b.abs().max()), f"step {s}"


def test_layer_names_are_the_reference_layout(qwen3_target, qwen3_cfg):
    d = build_drafter("eagle3", qwen3_target, qwen3_cfg)
    names = set(d.state_dict())
    dd = qwen3_target.hidden_size
    assert {"fc.weight", "norm.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
            "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    a = d.layers[0].self_attn
    assert a.q_proj.weight.shape == (4 * 16, 2 * dd) and a.k_proj.weight.shape == (2 * 16, 2 * dd)
    assert a.v_proj.weight.shape == (2 * 16, 2 * dd) and a.o_proj.weight.shape == (dd, 4 * 16)


# --------------------------------------------------------------------------- the loss


def _reference_step_masks(loss_mask, attention_mask, steps):
    """The reference's construction: the loss mask with each sequence's last token
    zeroed, shifted left (zero padded) once per TTT step."""
    pm = (loss_mask & attention_mask).float().clone()
    lengths = attention_mask.long().sum(1)
    pm[torch.arange(pm.shape[0]), (lengths - 1).clamp_min(0)] = 0
    out = []
    for _ in range(steps):
        out.append(pm.bool())
        pm = torch.cat([pm[:, 1:], torch.zeros_like(pm[:, :1])], 1)
    return out


def test_row_mask_is_the_reference_shift():
    g = torch.Generator().manual_seed(0)
    lm = torch.rand(3, 12, generator=g) > 0.3
    am = torch.ones(3, 12, dtype=torch.bool)
    am[1, 9:] = False
    am[2, 5:] = False
    lengths = am.long().sum(1)
    for s, want in enumerate(_reference_step_masks(lm, am, 7)):
        assert torch.equal(chain_row_mask(lm & am, lengths, s, "reference"), want)
        pred = chain_row_mask(lm & am, lengths, s, "predicted")
        t = torch.arange(12)
        ok = (t + 2 + s < 12)
        assert torch.equal(pred, ok & (lm & am)[:, (t + 2 + s).clamp(max=11)])
    v = chain_row_mask(lm & am, lengths, 0)
    assert chain_normalizer(v, "batch_tokens") == 36.0 and chain_normalizer(v, "valid_rows") == float(v.sum())


@pytest.mark.parametrize("rows,norm", [("reference", "batch_tokens"), ("predicted", "valid_rows")])
def test_chain_loss_equals_plain_sum(qwen3_target, qwen3_cfg, rows, norm):
    c = _cfg(qwen3_cfg, eagle3_row_mask=rows, eagle3_normalizer=norm)
    torch.manual_seed(0)
    d = build_drafter("eagle3", qwen3_target, c).eval()
    ids = torch.tensor([SEQ, SEQ[::-1]]) % qwen3_target.vocab_size
    feats, last = qwen3_target.features(ids, c["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    am = torch.ones_like(lm)
    am[1, 9:] = False
    batch = dict(input_ids=ids, loss_mask=lm, attention_mask=am, features=feats, last_hidden=last)
    with torch.no_grad():
        loss, m = d.training_step(batch, step_spec(c))
        outs = d(ids, feats, am)
        pt = torch.softmax(qwen3_target.lm_head(last).float(), -1)
    B, L = ids.shape
    t = torch.arange(L)
    want = 0.0
    for s, h in enumerate(outs):
        valid = chain_row_mask(lm & am, am.sum(1), s, rows)
        logp = torch.log_softmax(d.draft_logits(h).float(), -1)
        sce = -(pt[:, (t + 1 + s).clamp(max=L - 1)] * logp).sum(-1)
        den = B * L if norm == "batch_tokens" else valid.sum()
        want += 0.8**s * sce[valid].sum() / den
    assert abs(float(loss) - float(want)) < 1e-5 * max(1.0, float(want))


# --------------------------------------------------------------------------- decoding


def test_greedy_speculative_equals_plain_qwen3(qwen3_target, qwen3_cfg):
    t = qwen3_target
    prompt = [5, 6, 7]
    plain = plain_generate(t, prompt, max_new_tokens=20, temperature=0.0).tokens
    torch.manual_seed(0)
    d = build_drafter("eagle3", t, qwen3_cfg)
    ids = torch.tensor([prompt + plain])
    feats, last = t.features(ids, qwen3_cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, : len(prompt)] = False
    batch = dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)
    opt = torch.optim.AdamW(d.parameters(), lr=2e-2)
    d.train()
    for _ in range(30):
        loss, _ = d.training_step(batch, step_spec(qwen3_cfg))
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    gen = speculative_generate(t, d, prompt, feature_layers=qwen3_cfg["target"]["feature_layers"],
                               max_new_tokens=20, temperature=0.0)
    assert gen.tokens == plain
    assert sum(r["accepted"] for r in gen.rounds) > 0

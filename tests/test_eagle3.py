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

import pytest
import torch

from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.losses import chain_normalizer, chain_row_mask
from deepspec.drafters import build_drafter
from deepspec.training.run import step_spec

from helpers import plain_ttt, randomize

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




# --------------------------------------------------------------------------- plain-torch equations












def test_ttt_forward_equals_plain_equations(kind, tc):
    target, cfg = tc
    c = copy.deepcopy(cfg)
    c["drafter"]["num_layers"] = {"eagle3": 2}
    torch.manual_seed(0)
    d = randomize(build_drafter("eagle3", target, c).eval())
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

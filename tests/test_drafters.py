"""Drafters on the tiny targets: attention masks, train/inference agreement,
KV-cache consistency, a training step, save/load, reduced vocabulary,
init_from_target, and a small overfitting run per drafter.

Tests taking `target` / `target_cfg` run on both the Llama-style tiny target and
the tiny Gemma4 one (conftest.py); Gemma4-only checks are in test_gemma4.py."""
import copy
import json
import re

import pytest
import torch

from deepspec.drafters import build_drafter, load_drafter
from deepspec.drafters.dflash import block_attention_mask
from deepspec.drafters.eagle3 import ttt_mask
from deepspec.errors import DeepSpecError
from deepspec.training.run import step_spec

SEQ = [1, 2, 3, 500, 17, 923, 4411, 60, 7, 311, 2999, 12, 40, 5, 88, 1024]


def _cfg(tiny_cfg, **drafter):
    c = copy.deepcopy(tiny_cfg)
    c["drafter"].update(drafter)
    return c


@pytest.fixture(scope="module")
def seq_batch(target, target_cfg):
    ids = torch.tensor([SEQ]) % target.vocab_size  # Gemma4's vocabulary has 512 tokens
    feats, last = target.features(ids, target_cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    return dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)


def _drafter(method, target, cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return build_drafter(method, target, _cfg(cfg, **kw)).eval()


def test_block_mask_tensor():
    m = block_attention_mask(torch.tensor([[3, 5]]), ctx_len=8, gamma=3)[0, 0]
    assert m.shape == (6, 8 + 6)
    for row in range(6):
        p = [3, 5][row // 3]
        ctx = m[row, :8]
        assert ctx[:p].all() and not ctx[p:].any()  # context strictly before the anchor
        own = m[row, 8:].view(2, 3)
        assert own[row // 3].all() and not own[1 - row // 3].any()  # whole own block, no other block


def test_ttt_mask_tensor():
    m = ttt_mask(4, 2)[0, 0]
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


def test_block_sees_only_earlier_context(target, target_cfg, seq_batch):
    d = _drafter("dspark", target, target_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    p = 8
    anchors = torch.tensor([[p, 11]])
    with torch.no_grad():
        h0 = d(ids, f, anchors)
        f_late = f.clone()
        f_late[:, p:] += torch.randn_like(f_late[:, p:]) * 5
        h1 = d(ids, f_late, anchors)
        f_early = f.clone()
        f_early[:, p - 1] += torch.randn_like(f_early[:, p - 1]) * 5
        h2 = d(ids, f_early, anchors)
    assert torch.allclose(h0[:, 0], h1[:, 0], atol=1e-5)  # context at/after the anchor is invisible
    assert not torch.allclose(h0[:, 1], h1[:, 1], atol=1e-3)  # ... but visible to the later anchor
    assert not torch.allclose(h0[:, 0], h2[:, 0], atol=1e-3)  # earlier context matters


@pytest.mark.parametrize("method,kw", [("dflash", {}), ("dspark", {}), ("dspark", {"markov_head_type": "rnn"})])
def test_propose_matches_training_forward(target, target_cfg, seq_batch, method, kw):
    d = _drafter(method, target, target_cfg, **kw)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    st = d.init_state()
    d.propose(st, f[:, :5], ids[:, :6], temperature=1.0, generator=torch.Generator().manual_seed(0))
    P = 9  # second call: positions 5..8 verified, anchor at 9
    prop = d.propose(st, f[:, 5:P], ids[:, 5 : P + 1], temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert st.n == P and prop.tokens.shape == (1, d.gamma) and prop.probs.shape == (1, d.gamma, target.vocab_size)
    with torch.no_grad():
        h = d(ids, f, torch.tensor([[P]]))[0]  # [1, g, d]
        prev = torch.cat([ids[:, P : P + 1], prop.tokens[:, :-1]], 1)
        ref = torch.softmax(d.block_logits(h, prev), -1)
        conf = d.confidence_logits(h, prev)
    assert torch.allclose(prop.probs, ref, atol=1e-5)
    if method == "dspark":
        assert torch.allclose(prop.conf_logits, conf, atol=1e-5)
    else:
        assert prop.conf_logits is None
    # position 1's distribution never depends on the drafted tokens
    g = prop.tokens.clone()
    g[:, :-1] = (g[:, :-1] + 1) % target.vocab_size
    with torch.no_grad():
        ref2 = torch.softmax(d.block_logits(h, torch.cat([ids[:, P : P + 1], g[:, :-1]], 1)), -1)
    assert torch.allclose(ref2[:, 0], ref[:, 0])


def test_markov_bias_depends_only_on_previous_token(tiny_target, tiny_cfg):
    d = _drafter("dspark", tiny_target, tiny_cfg)
    h = torch.randn(2, d.gamma, tiny_target.hidden_size)
    prev = torch.randint(0, 1000, (2, d.gamma))
    with torch.no_grad():
        b0 = d.block_logits(h, prev) - d.draft_logits(h)
        prev2 = prev.clone()
        prev2[:, 3] += 1  # changes x_3: only position 4's bias may move
        b1 = d.block_logits(h, prev2) - d.draft_logits(h)
        h2 = h + torch.randn_like(h)  # the vanilla Markov bias ignores h
        b2 = d.block_logits(h2, prev) - d.draft_logits(h2)
    moved = (b0 - b1).abs().amax(-1).amax(0)
    assert moved[3] > 1e-4 and torch.all(moved[torch.arange(d.gamma) != 3] == 0)
    assert torch.allclose(b0, b2, atol=1e-5)


def test_eagle3_chain_cache_equals_recompute(target, target_cfg, seq_batch):
    d = _drafter("eagle3", target, target_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    st = d.init_state()
    d.propose(st, f[:, :4], ids[:, :5], temperature=0.0)
    P = 8
    prop = d.propose(st, f[:, 4:P], ids[:, 4 : P + 1], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert st.n == P and st.cache.length() == P  # cropped back to verified context
    seq = torch.cat([ids[:, : P + 1], prop.tokens], 1)  # anchor at P, then the drafted tokens
    feats = torch.cat([f[:, :P], torch.zeros(1, seq.shape[1] - P, f.shape[-1])], 1)
    with torch.no_grad():
        outs = d(seq, feats)
        ref = torch.stack([torch.softmax(d.draft_logits(o[:, P - 1]), -1) for o in outs], 1)
    assert torch.allclose(prop.probs, ref, atol=1e-5)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_kv_bytes_per_token_is_what_a_request_keeps(target, target_cfg, seq_batch, method):
    """P4: the drafter's context K/V per position (what the engine's admission and `plan`
    add to the target's KV cache) is what its state holds after a proposal."""
    d = _drafter(method, target, target_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    st = d.init_state()
    d.propose(st, f[:, :10], ids[:, :11], temperature=0.0)
    tensors = [*st.cache.k.values(), *st.cache.v.values()] if method == "eagle3" else [*st.k, *st.v]
    held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert held == 10 * d.kv_bytes_per_token()
    assert d.kv_bytes_per_token(torch.bfloat16) * 2 == d.kv_bytes_per_token()


def test_eagle3_chains_of_chosen_rows_equal_the_full_pass(target, target_cfg, seq_batch):
    """Steps > 0 run on a subset of rows (train.chain_rows): each kept row's
    states are those of the all-rows TTT pass."""
    d = _drafter("eagle3", target, target_cfg)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    rows = torch.tensor([[0, 5, 6, 13]])
    with torch.no_grad():
        full, part = d(ids, f), d(ids, f, rows=rows)
    assert torch.equal(full[0], part[0])
    for s in range(1, d.gamma):
        ref = full[s].gather(1, rows.unsqueeze(-1).expand(-1, -1, full[s].shape[-1]))
        assert part[s].shape == ref.shape and torch.allclose(part[s], ref, atol=1e-5), s


def test_eagle3_row_sampled_loss_is_unbiased(tiny_target, tiny_cfg):
    """With train.chain_rows every TTT step's loss is an unbiased estimate of
    the all-rows loss: exact when every row is kept, the full loss within its
    standard error over many samples of 3 rows, and different per sample."""
    import dataclasses

    ids = (torch.arange(2 * 24).view(2, 24) * 37 + 5) % tiny_target.vocab_size
    feats, last = tiny_target.features(ids, tiny_cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[0, :6], lm[1, :10] = False, False
    batch = dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)
    d = _drafter("eagle3", tiny_target, tiny_cfg)
    spec = step_spec(_cfg(tiny_cfg))
    with torch.no_grad():
        full = float(d.training_step(batch, spec)[0])
        every = float(d.training_step(batch, dataclasses.replace(spec, chain_rows=24),
                                      torch.Generator().manual_seed(0))[0])
        few = dataclasses.replace(spec, chain_rows=3)
        est = torch.tensor([float(d.training_step(batch, few, torch.Generator().manual_seed(i))[0])
                            for i in range(300)])
    assert every == pytest.approx(full, rel=1e-5)
    assert est.std() > 1e-3 * full  # the rows really are sampled
    assert abs(float(est.mean()) - full) < 4 * float(est.std()) / 300**0.5


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_training_step_gives_finite_gradients(target, target_cfg, seq_batch, method):
    d = _drafter(method, target, target_cfg).train()
    loss, m = d.training_step(seq_batch, step_spec(_cfg(target_cfg)), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and 0.0 <= m["c_star_1"] <= 1.0
    loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".self_attn." in n)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_save_load_roundtrip(target, target_cfg, seq_batch, tmp_path, method):
    d = _drafter(method, target, target_cfg, draft_vocab_size=300 if method == "dspark" else None)
    if method == "dspark":
        d.set_draft_vocab(torch.arange(target.vocab_size).flip(0).float())  # ids reversed: a non-trivial d2t
    d.save_pretrained(tmp_path / method)
    e = load_drafter(tmp_path / method, target)
    assert type(e) is type(d) and torch.equal(e.d2t, d.d2t)
    assert type(e.config) is type(d.config) and e.config.head_dim == d.config.head_dim
    assert getattr(e.config, "layer_types", None) == getattr(d.config, "layer_types", None)
    assert e.config.deepspec_feature_layers == list(target_cfg["target"]["feature_layers"])
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    for m in (d, e):
        m.eval()
    with torch.no_grad():
        if method == "eagle3":
            a, b = d(ids, f, steps=2)[-1], e(ids, f, steps=2)[-1]
        else:
            an = torch.tensor([[4, 9]])
            a, b = d(ids, f, an), e(ids, f, an)
        assert torch.equal(d.draft_logits(a), e.draft_logits(b))
    other = copy.copy(target)
    other.target_id = "other-target"
    with pytest.raises(DeepSpecError, match="target id"):
        load_drafter(tmp_path / method, other)


def test_load_rejects_other_vocab_or_width(tiny_target, tiny_cfg, tmp_path):
    d = _drafter("dflash", tiny_target, tiny_cfg)
    d.save_pretrained(tmp_path / "d")
    cfg = d.config
    for key, val, msg in [("deepspec_target_vocab_size", 1000, "vocab"), ("deepspec_target_hidden_size", 32, "hidden")]:
        c2 = copy.deepcopy(cfg)
        setattr(c2, key, val)
        c2.save_pretrained(tmp_path / "d")
        with pytest.raises(DeepSpecError, match=msg):
            load_drafter(tmp_path / "d", tiny_target)
    with pytest.raises(DeepSpecError):
        load_drafter(tmp_path / "missing", tiny_target)


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_reduced_vocab_probs_are_full_distributions(target, target_cfg, seq_batch, method):
    d = _drafter(method, target, target_cfg, draft_vocab_size=256)
    counts = torch.zeros(target.vocab_size)
    counts[torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:256]] = 1
    d.set_draft_vocab(counts)
    ids, f = seq_batch["input_ids"], seq_batch["features"]
    prop = d.propose(d.init_state(), f[:, :8], ids[:, :9], temperature=1.0, generator=torch.Generator().manual_seed(0))
    V = target.vocab_size
    assert prop.probs.shape == (1, d.gamma, V)
    assert torch.allclose(prop.probs.sum(-1), torch.ones(1, d.gamma), atol=1e-5)
    outside = torch.ones(V, dtype=torch.bool)
    outside[d.d2t] = False
    assert outside.sum() == V - 256 and torch.all(prop.probs[..., outside] == 0)
    assert torch.all(counts[prop.tokens] == 1)  # drafted tokens lie in the draft vocab
    g = prop.probs.gather(-1, prop.tokens.unsqueeze(-1))
    assert torch.all(g > 0)


def test_init_from_target_copies_last_layers(target, target_cfg):
    for method in ("dspark", "eagle3"):
        c = _cfg(target_cfg, init_from_target=True)
        c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 2, "dspark": 1}
        d = build_drafter(method, target, c)
        t_layer = target.model.get_decoder().layers[-1]  # Gemma4: a full-attention layer
        if method == "eagle3":  # 2d-wide q/k/v (standard EAGLE-3 layer): not copied
            assert d.layers[0].self_attn.q_proj.weight.shape[1] == 2 * t_layer.self_attn.q_proj.weight.shape[1]
            assert torch.equal(d.layers[0].mlp.down_proj.weight, t_layer.mlp.down_proj.weight)
            continue
        assert torch.equal(d.layers[0].self_attn.q_proj.weight, t_layer.self_attn.q_proj.weight)
        assert torch.equal(d.layers[0].mlp.down_proj.weight, t_layer.mlp.down_proj.weight)
        assert d.layers[0].self_attn.q_proj.weight.data_ptr() != t_layer.self_attn.q_proj.weight.data_ptr()


def test_shared_head_frozen_and_not_trainable(target, target_cfg):
    d = _drafter("dspark", target, target_cfg)
    n_embed = target.embed_tokens.weight.numel()
    names = [n for n, _ in d.named_parameters()]
    assert all(p.requires_grad for p in d.parameters())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert sum(p.numel() for p in d.parameters()) < sum(p.numel() for p in target.model.parameters()) + n_embed
    with pytest.raises(DeepSpecError, match="unknown drafter"):
        build_drafter("medusa", target, target_cfg)


def _overfit(method, target, cfg, batch, steps, lr, K=512, **kw):
    """Plain AdamW on one fixed sequence until analytic c*_1 > 0.9. A 512-token
    draft vocabulary chosen by target mass (>= 0.95 coverage here) keeps steps fast on 2 shared cores."""
    d = _drafter(method, target, cfg, draft_vocab_size=K, **kw)
    with torch.no_grad():
        mass = torch.softmax(target.lm_head(batch["last_hidden"][0]), -1).sum(0)
    d.set_draft_vocab(mass)
    c = copy.deepcopy(cfg)
    c["train"]["num_anchors"] = 16
    d.train()
    opt = torch.optim.AdamW(d.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        loss, m = d.training_step(batch, step_spec(c), gen)
        assert torch.isfinite(loss)
        if m["c_star_1"] > 0.9:
            return step, m
        opt.zero_grad()
        loss.backward()
        opt.step()
    pytest.fail(f"{method}: c*_1 = {m['c_star_1']:.3f} after {steps} steps ({m})")


@pytest.fixture(scope="module")
def sharp_target(tiny_target):
    """The tiny target with 20x logits: CE-only DFlash can only reach c* > 0.9
    where the target itself is near-deterministic (c* <= p_t(label))."""
    t = copy.copy(tiny_target)
    t.model = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        t.model.model.norm.weight.mul_(20.0)
    return t


@pytest.mark.parametrize("method", ["dspark", "eagle3", "dflash"])
def test_each_drafter_overfits(tiny_target, sharp_target, tiny_cfg, method):
    tg = sharp_target if method == "dflash" else tiny_target
    # the target's own greedy continuation (what regenerated training data looks like)
    ids = tg.model.generate(
        torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=9, do_sample=False
    )
    feats, last = tg.features(ids, tiny_cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    batch = dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)
    step, m = _overfit(method, tg, tiny_cfg, batch, steps=150, lr=2e-2 if method == "dspark" else 1e-2)
    assert m["tau_expected"] > 1.9


def test_damaged_drafter_files_are_one_line_errors(tiny_target, tiny_cfg, tmp_path):
    d = build_drafter("dflash", tiny_target, tiny_cfg)
    d.save_pretrained(tmp_path / "d")
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(DeepSpecError, match="cannot load the drafter at"):
        load_drafter(tmp_path / "d", tiny_target)
    weights.unlink()
    with pytest.raises(DeepSpecError, match="cannot load the drafter at"):
        load_drafter(tmp_path / "d", tiny_target)
    (tmp_path / "d" / "config.json").write_text("{deepspec_method: dflash")
    with pytest.raises(DeepSpecError, match=r"config\.json: malformed drafter config"):
        load_drafter(tmp_path / "d", tiny_target)


def _saved(method, tiny_target, tiny_cfg, where):
    d = build_drafter(method, tiny_target, tiny_cfg)
    d.save_pretrained(where)
    return where


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update({k: v(cfg[k]) if callable(v) else v for k, v in changes.items()})
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_drafter_missing_a_tensor_is_refused_not_initialised(tiny_target, tiny_cfg, tmp_path):
    """B11: a tensor deleted from model.safetensors (or a missing d2t buffer, B9) is one
    line naming the file and the tensor, never a weight made up at random."""
    d = _saved("dspark", tiny_target, tiny_cfg, tmp_path / "d")
    up = next(k for k in load_drafter(d, tiny_target).state_dict() if "mlp.up_proj.weight" in k)
    _edit_weights(d, lambda s: s.pop(up))
    with pytest.raises(DeepSpecError, match=rf"config\.json: {re.escape(up)} is not in the weights file") as e:
        load_drafter(d, tiny_target)
    assert "\n" not in str(e.value)
    d2 = _saved("dflash", tiny_target, tiny_cfg, tmp_path / "d2")
    _edit_weights(d2, lambda s: s.pop("d2t"))
    with pytest.raises(DeepSpecError, match=r"d2t is not in the weights file"):
        load_drafter(d2, tiny_target)


def test_a_tampered_drafter_config_names_the_tensor_and_the_key(tiny_target, tiny_cfg, tmp_path):
    """B8 / B10: a config.json whose sizes do not match the weights (Markov rank, one
    layer more) is one line naming the tensor and the config key."""
    d = _saved("dspark", tiny_target, tiny_cfg, tmp_path / "d")
    _edit_config(d, deepspec_markov_rank=lambda r: r * 2)
    with pytest.raises(DeepSpecError, match=r"markov.* is \[.*\], but config\.json \(.*deepspec_markov_rank.*\) implies") as e:
        load_drafter(d, tiny_target)
    assert "\n" not in str(e.value)
    for i, delta in enumerate((1, -1)):  # a layer more or less than the weights hold
        d2 = _saved("dflash", tiny_target, tiny_cfg, tmp_path / f"d2_{i}")
        _edit_config(d2, num_hidden_layers=lambda n: n + delta)
        with pytest.raises(DeepSpecError, match=r"config\.json: num_hidden_layers is \d+, but the weights file has "
                                                r"\d+ draft layers") as e:
            load_drafter(d2, tiny_target)
        assert "\n" not in str(e.value)


def _one_line(path, target, *patterns, drafter_cfg=None):
    """load_drafter refuses `path` with a one-line DeepSpecError that names its config.json and each pattern."""
    with pytest.raises(DeepSpecError) as e:
        load_drafter(path, target, drafter_cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}/"), msg
    for pattern in patterns:
        assert re.search(pattern, msg), (pattern, msg)
    return msg


@pytest.mark.parametrize("delta", [1, -1])
def test_a_qwen3_layer_drafter_with_a_layer_more_or_less_is_one_line(tiny_target, tiny_cfg, tmp_path, delta):
    """B10: num_hidden_layers +-1 in a Qwen3-layer DSpark drafter's config.json fails
    transformers' config validation with huggingface_hub's StrictDataclassClassValidationError
    (an Exception, not a ValueError): one line naming config.json and the key, no traceback."""
    cfg = _cfg(tiny_cfg, layer_arch="qwen3")
    d = _saved("dspark", tiny_target, cfg, tmp_path / "d")
    _edit_config(d, num_hidden_layers=lambda n: n + delta)
    _one_line(d, tiny_target, r"^\S+/config\.json: ", r"\(config num_hidden_layers, layer_types\)",
              r"must be equal to the number of `layer_types`", drafter_cfg=cfg["drafter"])


def test_every_invalid_drafter_config_value_is_one_line_naming_the_key(tiny_target, tiny_cfg, tmp_path):
    """A config.json value transformers' validators refuse (a hidden size no multiple of
    the heads, a field of the wrong type), one the drafter cannot be built of (zero heads),
    or a deepspec_* field of the wrong type: one line naming config.json and the key."""
    cases = [
        ("eagle3", {"num_attention_heads": 3}, [r"config\.json: not a valid drafter config \(config hidden_size, "
                                                r"num_attention_heads\): The hidden size \(64\) is not a multiple"]),
        ("eagle3", {"attention_bias": None}, [r"\(config attention_bias\)", "expected bool"]),
        ("dflash", {"num_key_value_heads": 0}, [r"config\.json: num_key_value_heads is 0, but it must be a positive"]),
        ("dflash", {"hidden_act": "nope"}, [r"\(config hidden_act\)"]),
        ("dspark", {"deepspec_feature_layers": "x"}, [r"deepspec_feature_layers is \"x\", but it must be a list"]),
        ("dspark", {"deepspec_markov_rank": None}, [r"deepspec_markov_rank is null, but it must be an integer >= 0"]),
        ("dspark", {"dtype": "x"}, [r"config\.json: dtype is \"x\""]),
        ("dspark", {"num_hidden_layers": 10**12}, [r"num_hidden_layers is 1000000000000, but the weights file has"]),
    ]
    for i, (method, change, patterns) in enumerate(cases):
        d = _saved(method, tiny_target, tiny_cfg, tmp_path / f"d{i}")
        _edit_config(d, **change)
        _one_line(d, tiny_target, *patterns)


def test_a_tampered_drafter_config_names_its_size_or_method_key(tiny_target, tiny_cfg, tmp_path):
    """B8 beyond the Markov rank: a changed hidden size, head size or intermediate size
    names that key (the config's sizes against the draft config of the target); a
    changed deepspec_method (weights of another drafter) names deepspec_method."""
    qwen3 = _cfg(tiny_cfg, layer_arch="qwen3")
    cases = [
        ("dspark", tiny_cfg, {"hidden_size": lambda h: h // 2}, [r"model\.safetensors: \S+ is \[\d+.*\], but config\.json "
                                                                 r"\(hidden_size\) implies"]),
        ("dspark", qwen3, {"head_dim": lambda h: h * 2}, [r"q_proj\.weight is .*config\.json \(head_dim\) implies"]),
        ("dflash", tiny_cfg, {"intermediate_size": lambda n: n * 2}, [r"\(intermediate_size\) implies"]),
        ("eagle3", tiny_cfg, {"deepspec_method": "dspark"}, [r"config\.json: deepspec_method is 'dspark', but the weights "
                                                            r"file holds the tensors of the eagle3 method"]),
        ("dspark", tiny_cfg, {"deepspec_method": "eagle3"}, [r"deepspec_method is 'eagle3'.* of the dspark method"]),
        ("dspark", tiny_cfg, {"deepspec_method": "dflash"}, [r"deepspec_method is 'dflash'.* of the dspark method"]),
    ]
    for i, (method, cfg, change, patterns) in enumerate(cases):
        d = _saved(method, tiny_target, cfg, tmp_path / f"d{i}")
        _edit_config(d, **change)
        _one_line(d, tiny_target, *patterns, drafter_cfg=cfg["drafter"])


def test_non_finite_drafter_weights_are_refused(tiny_target, tiny_cfg, tmp_path):
    """B12: NaN weights are not evaluated or exported (both load through load_drafter)."""
    d = _saved("eagle3", tiny_target, tiny_cfg, tmp_path / "d")
    name = next(k for k, v in load_drafter(d, tiny_target).state_dict().items() if v.is_floating_point())

    def poison(s):
        s[name] = s[name].clone()
        s[name].view(-1)[0] = float("nan")

    _edit_weights(d, poison)
    with pytest.raises(DeepSpecError, match=rf"{re.escape(name)} has 1 non-finite value"):
        load_drafter(d, tiny_target)

"""export-checkpoint (deepspec/formats/export.py) and converting DeepSeek's
released Eagle3 layout (deepspec/formats/convert.py), on the tiny Qwen3 and
Gemma4 targets; the engines themselves are not run (docs/FORMATS.md).

* deepspec layout: export, then convert back, gives a drafter with bit-identical
  outputs, for every drafter family (Eagle3, DFlash, DSpark; reserved mask token
  and learned mask embedding).
* eagle3 layout: config fields and tensor names/shapes against the schema of
  docs/FORMATS.md (`eagle3.expected_tensors`), d2t/t2d conventions, and the
  exported tensors compute the drafter's function (plain-torch equations).
* A synthetic checkpoint in DeepSeek's released Eagle3 layout, built from the
  documented names and shapes, converts and computes the plain-torch equations.
* Refusals: one line, nothing written.
"""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepspec.drafters import build_drafter, load_drafter
from deepspec.errors import DeepSpecError
from deepspec.files import OUTPUT_MARKER
from deepspec.formats import common, convert, deepspec_layout, eagle3, export, sglang

from helpers import plain_ttt, random_drafter

SEQ = [5, 9, 3, 500, 17, 92, 441, 60, 7, 311, 299, 12, 40, 88]


_drafter = random_drafter


def _outputs(d, ids, f):
    """Everything a drafter computes on a fixed input: training forward and proposals."""
    for t in list(d.parameters()) + list(d.buffers()):
        t.data = t.data.clone()  # aligned copies (see test_convert._compare)
    with torch.no_grad():
        fwd = d(ids, f, steps=3) if d.method == "eagle3" else [d(ids, f, torch.tensor([[4, 9]]))]
    props = []
    for temperature in (0.0, 1.0):
        st = d.init_state()
        d.propose(st, f[:, :5], ids[:, :6], temperature=temperature, generator=torch.Generator().manual_seed(3))
        p = d.propose(st, f[:, 5:9], ids[:, 5:10], temperature=temperature, generator=torch.Generator().manual_seed(4))
        props += [p.tokens, p.probs] + ([p.conf_logits] if p.conf_logits is not None else [])
    return fwd + props


def _batch(target, cfg):
    ids = torch.tensor([SEQ]) % target.vocab_size
    return ids, target.features(ids, cfg["target"]["feature_layers"])[0]


ROUND_TRIPS = {  # name: (target fixture, cfg fixture, method, drafter settings)
    "qwen3-eagle3": ("qwen3_target", "qwen3_cfg", "eagle3", {}),
    "qwen3-dflash-reserved-mask": ("qwen3_target", "qwen3_cfg", "dflash", {"mask_token_id": 11}),
    "qwen3-dspark-learned-mask": ("qwen3_target", "qwen3_cfg", "dspark", {}),
    "qwen3-dspark-rnn-reserved-mask": ("qwen3_target", "qwen3_cfg", "dspark", {"mask_token_id": 3,
                                                                               "markov_head_type": "rnn"}),
    "gemma4-eagle3": ("gemma4_target", "gemma4_cfg", "eagle3", {}),
    "gemma4-dspark-reserved-mask": ("gemma4_target", "gemma4_cfg", "dspark", {"mask_token_id": 4}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_deepspec_export_then_convert_is_identical(case, request, tmp_path):
    tname, cname, method, kw = ROUND_TRIPS[case]
    target, cfg = request.getfixturevalue(tname), request.getfixturevalue(cname)
    d, _ = _drafter(method, target, cfg, **kw)
    if "mask_token_id" in kw:  # build_drafter froze the target's embedding of the reserved token
        assert not d.mask_embedding.requires_grad
    d.save_pretrained(tmp_path / "ours")
    d = load_drafter(tmp_path / "ours", target)
    out = export.export_drafter(d, target, "deepspec", tmp_path / "ref")
    cfg_json = json.loads((out / "config.json").read_text())
    prefix = "Gemma4" if tname.startswith("gemma4") else "Qwen3"
    assert cfg_json["architectures"] == [prefix + ("Eagle3Model" if method == "eagle3" else "DSparkModel")]
    assert cfg_json["target_layer_ids"] == cfg["target"]["feature_layers"]
    assert not any(k.startswith("deepspec_") and k not in ("deepspec_exported_from", "deepspec_note",
                                                           convert.MASK_ROW_FIELD) for k in cfg_json)
    if method != "eagle3":
        assert cfg_json["markov_rank"] == (0 if method == "dflash" else cfg["drafter"]["markov_rank"])
        assert cfg_json["mask_token_id"] == kw.get("mask_token_id", target.vocab_size - 1)
        assert bool(cfg_json.get(convert.MASK_ROW_FIELD)) == ("mask_token_id" not in kw)
    names = set(load_file(str(out / "model.safetensors")))
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "norm.weight"} <= names
    e = load_drafter(convert.convert_reference_checkpoint(out, target, tmp_path / "back"), target)
    assert type(e) is type(d)
    sd0, sd1 = d.state_dict(), e.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    ids, f = _batch(target, cfg)
    for a, b in zip(_outputs(d, ids, f), _outputs(e, ids, f)):
        assert torch.equal(a, b)


def test_eagle3_export_schema_and_function(qwen3_target, qwen3_cfg, tmp_path):
    c = copy.deepcopy(qwen3_cfg)
    c["target"]["feature_layers"] = [-1, 0, 1]
    d, c = _drafter("eagle3", qwen3_target, c, draft_vocab_size=300)
    d.set_draft_vocab(torch.arange(qwen3_target.vocab_size).flip(0).float())
    out = export.export_drafter(d, qwen3_target, "eagle3", tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 512 and cfg["draft_vocab_size"] == 300 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # vLLM: input of layer j = our output of j-1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]  # SGLang adds the 1 itself
    assert cfg["tie_word_embeddings"] is False
    sd = load_file(str(out / "model.safetensors"))
    want = eagle3.expected_tensors("eagle3", cfg)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert "embed_tokens.weight" not in sd
    draft = torch.arange(300)
    assert sd["d2t"].dtype == torch.int64 and torch.equal(draft + sd["d2t"], d.d2t)  # target id = draft id + d2t
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 300 and bool(sd["t2d"][d.d2t].all())
    assert torch.equal(sd["lm_head.weight"], qwen3_target.lm_head.weight[d.d2t])
    # the exported tensors compute the drafter's function (plain-torch equations)
    W = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    ids, f = _batch(qwen3_target, c)
    with torch.no_grad():
        ours = d(ids, f, steps=2)
        ref = plain_ttt(d, W, ids, f, 2, "qwen3", qwen3_target.embed_tokens)
    for a, b in zip(ours, ref):
        assert (a - b).abs().max() < 2e-4 * max(1.0, b.abs().max())
        assert torch.equal(d.draft_logits(a).argmax(-1), (b @ W["lm_head.weight"].T).argmax(-1))


def _fails(d, target, fmt, out, match):
    with pytest.raises(DeepSpecError, match=match) as ei:
        export.export_drafter(d, target, fmt, out)
    assert "\n" not in str(ei.value) and not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_refusals(tiny_target, tiny_cfg, qwen3_target, qwen3_cfg, gemma4_target, gemma4_cfg, tmp_path):
    llama, _ = _drafter("eagle3", tiny_target, tiny_cfg)
    _fails(llama, tiny_target, "deepspec", tmp_path / "a", "Qwen3 and Gemma4")
    # E3: SGLang 0.5.23 sizes fc from eagle_config's layer list (llama_eagle3.py), any count
    sg = json.loads((export.export_drafter(llama, tiny_target, "eagle3", tmp_path / "b", engine="sglang")
                     / "config.json").read_text())
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == tiny_cfg["target"]["feature_layers"]
    cfg = json.loads((export.export_drafter(llama, tiny_target, "eagle3", tmp_path / "b2", engine="vllm")
                      / "config.json").read_text())  # vLLM sizes fc from the list: any number of layers
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [x + 1 for x in tiny_cfg["target"]["feature_layers"]]
    dspark, _ = _drafter("dspark", qwen3_target, qwen3_cfg)
    _fails(dspark, qwen3_target, "eagle3", tmp_path / "c", "only Eagle3 drafters")
    g4, _ = _drafter("eagle3", gemma4_target, gemma4_cfg)
    _fails(g4, gemma4_target, "eagle3", tmp_path / "d", "gemma4_text Eagle3 layer")
    reduced, _ = _drafter("eagle3", qwen3_target, qwen3_cfg, draft_vocab_size=100)
    _fails(reduced, qwen3_target, "deepspec", tmp_path / "e", "reduced draft vocabulary")
    c = copy.deepcopy(qwen3_cfg)
    c["drafter"]["num_layers"] = {"eagle3": 2}
    torch.manual_seed(0)
    deep = build_drafter("eagle3", qwen3_target, c)
    _fails(deep, qwen3_target, "eagle3", tmp_path / "f", "one decoder layer")
    with pytest.raises(DeepSpecError, match="unknown format"):
        export.export_drafter(deep, qwen3_target, "medusa", tmp_path / "g")


def _fails_for(d, target, fmt, engine, out, match):
    with pytest.raises(DeepSpecError, match=match) as ei:
        export.export_drafter(d, target, fmt, out, engine=engine)
    assert "\n" not in str(ei.value) and not out.exists()


def test_engine_refusals(qwen3_target, qwen3_cfg, gemma4_target, gemma4_cfg, tmp_path):
    """What vLLM / SGLang would load wrongly (docs/FORMATS.md §1.2, §2)."""
    for kind in ("rnn", "gated"):
        d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3, markov_head_type=kind)
        _fails_for(d, qwen3_target, "deepspec", "vllm", tmp_path / kind, f"vanilla Markov head only, this drafter's is '{kind}'")
    learned, _ = _drafter("dspark", qwen3_target, qwen3_cfg)
    _fails_for(learned, qwen3_target, "deepspec", "sglang", tmp_path / "s", "learned mask embedding, which SGLang replaces")
    g4_learned, _ = _drafter("dspark", gemma4_target, gemma4_cfg)
    _fails_for(g4_learned, gemma4_target, "deepspec", "vllm", tmp_path / "gl", "learned mask embedding.*drafter.mask_token_id")
    with pytest.raises(DeepSpecError, match="--mask-token-id: a learned mask embedding goes into a new row V"):
        export.export_drafter(learned, qwen3_target, "deepspec", tmp_path / "mt", engine="vllm", mask_token_id=5)
    e3, _ = _drafter("eagle3", qwen3_target, qwen3_cfg)
    _fails_for(e3, qwen3_target, "deepspec", "vllm", tmp_path / "e", "--format eagle3")
    _fails_for(e3, qwen3_target, "eagle3", "sglang", tmp_path / "q", "LlamaForCausalLMEagle3")
    g4, _ = _drafter("dspark", gemma4_target, gemma4_cfg, mask_token_id=4, draft_vocab_size=100)
    _fails_for(g4, gemma4_target, "deepspec", "vllm", tmp_path / "g", "Gemma4 DSpark has a full-vocabulary head only")
    with pytest.raises(DeepSpecError, match="unknown engine 'trt'"):
        export.export_drafter(e3, qwen3_target, "eagle3", tmp_path / "t", engine="trt")


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_export_fields(qwen3_target, qwen3_cfg, method, tmp_path):
    """vLLM's Qwen3 DSpark reads a reduced draft vocabulary (draft_vocab_size, lm_head [K, d],
    d2t offsets, markov_w2 [K, r]); the export names the serve settings of the T = 1 protocol."""
    d, _ = _drafter(method, qwen3_target, qwen3_cfg, mask_token_id=3, draft_vocab_size=300)
    d.set_draft_vocab(torch.arange(qwen3_target.vocab_size).flip(0).float())
    out = export.export_drafter(d, qwen3_target, "deepspec", tmp_path / "v", engine="vllm")
    cfg = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    assert cfg["draft_vocab_size"] == 300 and cfg["vocab_size"] == 512 and cfg["mask_token_id"] == 3
    assert torch.equal(sd["lm_head.weight"], qwen3_target.lm_head.weight[d.d2t])
    assert sd["d2t"].dtype == torch.int64 and torch.equal(torch.arange(300) + sd["d2t"], d.d2t)
    assert sd["embed_tokens.weight"].shape == (512, 64)
    assert cfg["deepspec_serve_vllm"] == {"speculative_config": {
        "method": "dspark", "draft_sample_method": "probabilistic", "num_speculative_tokens": 7}}
    if method == "dspark":
        r = qwen3_cfg["drafter"]["markov_rank"]
        assert sd["markov_head.markov_w2.weight"].shape == (300, r) and sd["markov_head.markov_w1.weight"].shape == (512, r)
        assert convert.NULL_MARKOV_FIELD not in cfg
    else:  # vLLM serves DeepSpec's DFlash block as dspark only: a null Markov head, no zero-width layer
        assert cfg["markov_rank"] == common.NULL_MARKOV_RANK == 1 and cfg["markov_head_type"] == "vanilla"
        assert cfg[convert.NULL_MARKOV_FIELD] is True and cfg["enable_confidence_head"] is False
        assert sd["markov_head.markov_w1.weight"].shape == (512, 1) and sd["markov_head.markov_w2.weight"].shape == (300, 1)
        assert not sd["markov_head.markov_w1.weight"].any() and not sd["markov_head.markov_w2.weight"].any()
    _fails(d, qwen3_target, "deepspec", tmp_path / "plain", "reduced draft vocabulary.*--engine vllm")


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_export_of_a_learned_mask_appends_it_as_token_v(tiny_target, tiny_cfg, method, tmp_path):
    """The CPU presets' block drafters (SmolLM2: a Llama target without a reserved token,
    Qwen3 draft layers, a reduced vocabulary) for vLLM: the learned mask embedding is
    token V of the drafter's own embed_tokens (V + 1 rows, the target's first), which vLLM's
    Qwen3 DSpark keeps instead of sharing the target's; markov_w1 has a zero row V; no
    token's embedding is overwritten. The speculators format says the same; convert-checkpoint
    refuses the export in one line (it has no such token)."""
    target, V = tiny_target, tiny_target.vocab_size
    d, _ = _drafter(method, target, tiny_cfg, layer_arch="qwen3", draft_vocab_size=300)
    d.set_draft_vocab(torch.arange(V).flip(0).float())
    assert d.config.model_type == "qwen3" and d.config.deepspec_mask_token_id is None
    out = export.export_drafter(d, target, "deepspec", tmp_path / "v", engine="vllm")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg[convert.MASK_APPENDED_FIELD] is True
    assert cfg["vocab_size"] == V + 1 and cfg["mask_token_id"] == V and cfg["draft_vocab_size"] == 300
    assert convert.MASK_ROW_FIELD not in cfg
    emb = sd["embed_tokens.weight"]
    assert torch.equal(emb[:V], target.embed_tokens.weight) and torch.equal(emb[V], d.mask_embedding.detach())
    w1 = sd["markov_head.markov_w1.weight"]
    assert w1.shape[0] == V + 1 and not w1[V].any()
    if method == "dspark":
        assert torch.equal(w1[:V], d.state_dict()["markov.embed.weight"])
    spec = export.export_drafter(d, target, "speculators", tmp_path / "sp")
    spec_cfg = json.loads((spec / "config.json").read_text())
    assert spec_cfg["transformer_layer_config"]["vocab_size"] == V + 1 and spec_cfg["mask_token_id"] == V
    with pytest.raises(DeepSpecError, match="learned mask embedding is an extra token") as ei:
        convert.convert_reference_checkpoint(out, target, tmp_path / "back")
    assert "\n" not in str(ei.value) and not (tmp_path / "back").exists()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_learned_mask_over_the_full_vocabulary_drafts_v_tokens(tiny_target, tiny_cfg, method, tmp_path):
    """A learned mask with the full vocabulary (no draft_vocab_size): the input vocabulary
    is V + 1 but the drafted one V, so draft_vocab_size = V is written, in both layouts
    (engines size lm_head and markov_w2 by it and would otherwise build V + 1 rows)."""
    target, V = tiny_target, tiny_target.vocab_size
    d, _ = _drafter(method, target, tiny_cfg, layer_arch="qwen3")
    assert not d.reduced_vocab and d.config.deepspec_mask_token_id is None
    out = export.export_drafter(d, target, "deepspec", tmp_path / "v", engine="vllm")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["vocab_size"] == V + 1 and cfg["draft_vocab_size"] == V
    assert sd["lm_head.weight"].shape[0] == sd["markov_head.markov_w2.weight"].shape[0] == V
    spec_cfg = json.loads((export.export_drafter(d, target, "speculators", tmp_path / "sp") / "config.json").read_text())
    assert spec_cfg["draft_vocab_size"] == V and spec_cfg["transformer_layer_config"]["vocab_size"] == V + 1


def test_vllm_dflash_export_converts_back_to_the_same_dflash(qwen3_target, qwen3_cfg, tmp_path):
    """The null Markov head of a vLLM DFlash export is dropped again by convert-checkpoint:
    the same DFlash drafter, bit for bit, with the same proposals."""
    target, cfg = qwen3_target, qwen3_cfg
    d, _ = _drafter("dflash", target, cfg, mask_token_id=11)
    out = export.export_drafter(d, target, "deepspec", tmp_path / "v", engine="vllm")
    assert json.loads((out / "config.json").read_text())["markov_rank"] == 1
    e = load_drafter(convert.convert_reference_checkpoint(out, target, tmp_path / "back"), target)
    assert e.method == "dflash" and e.config.deepspec_markov_rank == 0
    sd0, sd1 = d.state_dict(), e.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    ids, f = _batch(target, cfg)
    for a, b in zip(_outputs(d, ids, f), _outputs(e, ids, f)):
        assert torch.equal(a, b)
    sd = load_file(str(out / "model.safetensors"))  # a null head that is not zero is refused
    sd["markov_head.markov_w2.weight"][3, 0] = 1.0
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(DeepSpecError, match="markov_w2.weight is not zero"):
        convert.convert_reference_checkpoint(out, target, tmp_path / "back2")


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_gemma4_export_has_exactly_the_loaders_names(gemma4_target, gemma4_cfg, method, tmp_path):
    """M5: vLLM's Gemma4 DSpark loader skips unknown names and leaves missing ones at
    their initial value, silently: a Gemma4 export for vLLM holds exactly its names
    (layer_scalar included, no v_proj with keys as values; the Markov head, a null one
    for DFlash; vLLM 0.32 also loads the confidence head), else it is refused."""
    d, _ = _drafter(method, gemma4_target, gemma4_cfg, mask_token_id=4)
    out = export.export_drafter(d, gemma4_target, "deepspec", tmp_path / "v", engine="vllm")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    want = {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"}
    want |= {f"layers.{i}.{name}" for i in range(n) for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight", "layer_scalar")}
    want |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if method == "dspark" and gemma4_cfg["drafter"]["confidence_head"]:
        want |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert set(sd) == want
    lacking = {k: v for k, v in sd.items() if k != "layers.1.layer_scalar"}
    with pytest.raises(DeepSpecError, match="lacks layers.1.layer_scalar, which vLLM's Gemma4 DSpark loader would"):
        deepspec_layout.check_vllm_gemma4_names(cfg, lacking)
    extra = dict(sd, **{"layers.0.self_attn.v_proj.weight": sd["layers.0.self_attn.k_proj.weight"]})
    with pytest.raises(DeepSpecError, match="has layers.0.self_attn.v_proj.weight, which vLLM's Gemma4 DSpark loader skips"):
        deepspec_layout.check_vllm_gemma4_names(cfg, extra)


# --------------------------------------------------------------------------- SGLang's DSPARK (Qwen3DSparkModel)
# Names and shapes SGLang's Qwen3DSparkModel holds, read from the sglang 0.5.23 wheel (PyPI,
# python/sglang/srt/...; not imported here: tests/engine/test_sglang_loaders.py runs that class's loader): for the tiny Qwen3 drafter of these tests
# (d 64, 4 heads, 2 KV heads, head_dim 16, intermediate 128, V 512, rank 32, 2 draft layers, 2 feature layers).
#   models/dflash.py:745 norm, :772 fc = Linear(num_context_features * hidden, hidden) (m * d -> d), :775 hidden_norm;
#     per layer :238-250 qkv_proj (loaded from q/k/v_proj, stacked mapping :887-893), o_proj, q_norm/k_norm [head_dim],
#     :479/:486 gate_up_proj (gate/up_proj) and down_proj, :611/:619 input/post_attention_layernorm;
#     unknown names are ignored silently (:945), missing ones never checked.
#   models/dspark.py:198-199 VanillaMarkov markov_w1 = Embedding(V, r), markov_w2 = Linear(r, V) -> [V, r];
#     :345 RNNHead joint_proj = Linear(2r + d, 3r); :313 GatedMarkovHead gate_proj = Linear(d + r, r);
#     :437 DSparkConfidenceHead proj = Linear(d (+ r with markov, default markov_rank > 0 :497), 1), bias;
#     :510 and :638: lm_head.* and embed_tokens.* are skipped (the target's are attached).
_D, _HD, _I, _V, _R = 64, 16, 128, 512, 32
SGLANG_LAYER = {"self_attn.q_proj.weight": (4 * _HD, _D), "self_attn.k_proj.weight": (2 * _HD, _D),
                "self_attn.v_proj.weight": (2 * _HD, _D), "self_attn.o_proj.weight": (_D, 4 * _HD),
                "self_attn.q_norm.weight": (_HD,), "self_attn.k_norm.weight": (_HD,),
                "mlp.gate_proj.weight": (_I, _D), "mlp.up_proj.weight": (_I, _D), "mlp.down_proj.weight": (_D, _I),
                "input_layernorm.weight": (_D,), "post_attention_layernorm.weight": (_D,)}
SGLANG_TOP = {"fc.weight": (_D, 2 * _D), "hidden_norm.weight": (_D,), "norm.weight": (_D,),
              "markov_head.markov_w1.weight": (_V, _R), "markov_head.markov_w2.weight": (_V, _R),
              "embed_tokens.weight": (_V, _D), "lm_head.weight": (_V, _D)}  # the last two: skipped by SGLang
SGLANG_RNN = {"markov_head.joint_proj.weight": (3 * _R, 2 * _R + _D), "markov_head.joint_proj.bias": (3 * _R,)}
SGLANG_CONFIDENCE = {True: {"confidence_head.proj.weight": (1, _D + _R), "confidence_head.proj.bias": (1,)},
                     False: {"confidence_head.proj.weight": (1, _D), "confidence_head.proj.bias": (1,)}}


@pytest.mark.parametrize("kind,confidence,with_markov", [("vanilla", True, True), ("rnn", True, True),
                                                          ("vanilla", True, False), ("rnn", False, False)])
def test_sglang_export_holds_exactly_sglangs_names(qwen3_target, qwen3_cfg, kind, confidence, with_markov, tmp_path):
    d, c = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3, markov_head_type=kind,
                    confidence_head=confidence, confidence_with_markov=with_markov)
    assert (c["drafter"]["markov_rank"], d.config.hidden_size, d.config.num_hidden_layers) == (_R, _D, 2)
    out = export.export_drafter(d, qwen3_target, "deepspec", tmp_path / "s", engine="sglang")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    want = dict(SGLANG_TOP, **{f"layers.{i}.{k}": v for i in range(2) for k, v in SGLANG_LAYER.items()})
    want.update(SGLANG_RNN if kind == "rnn" else {})
    want.update(SGLANG_CONFIDENCE[with_markov] if confidence else {})
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert {k: v for k, v in sglang.sglang_dspark_tensors(cfg).items()} == {
        k: v for k, v in want.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    # the config fields SGLang's parse_dspark_draft_config / build_* read (dspark_config.py, dspark.py)
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == _R and cfg["markov_head_type"] == kind
    assert cfg["block_size"] == 7 and cfg["mask_token_id"] == 3 and cfg["target_layer_ids"] == [0, 1]
    assert cfg["num_target_layers"] == 3 and cfg["sample_from_anchor"] is True
    assert cfg["enable_confidence_head"] is confidence
    assert cfg.get("confidence_head_with_markov") == (with_markov if confidence else None)
    assert cfg["deepspec_serve_sglang"] == dict({"speculative_algorithm": "DSPARK", "speculative_dspark_block_size": 7},
                                                **({} if confidence else {"env": {"SGLANG_RAGGED_VERIFY_MODE": "static"}}))
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "config.json", "model.safetensors"]
    # the tensors are the drafter's, under the reference names (RNN cell = joint_proj, same [s; W1[x]; h] order)
    ours = d.state_dict()
    for name, t in sd.items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(t, ours[convert.to_ours(name)])
    assert torch.equal(sd["lm_head.weight"], qwen3_target.lm_head.weight)


def _alg1(tmp_path, gamma=7, temps=None, ece=True):
    a = tmp_path / "gsm8k.alg1.json"
    a.write_text(json.dumps({"target": "tiny-qwen3", "method": "dspark", "benchmark": "gsm8k", "gamma": gamma,
                             "sts_temperatures": temps or [0.5 + 0.25 * k for k in range(gamma)],
                             "n_rounds_fit": 40, "n_rounds_eval": 38,
                             "sps": {"batch_tokens": [1, 2, 3, 4, 8], "steps_per_s": [50.0, 49.0, 47.5, 46.0, 40.0]}}))
    if ece:
        rows = "\n".join(f"{k},{0.1 + k / 100},{0.05 + k / 200},0.7,10,1.0,0.7" for k in range(1, gamma + 1))
        (tmp_path / "gsm8k.calibration.csv").write_text(
            "position,ece_before,ece_after,auroc,n,temperature,auroc_after\n" + rows + "\n")
    return a


def test_sglang_sts_and_sps_files(qwen3_target, qwen3_cfg, tmp_path):
    """Our STS temperatures and SPS(B) as SGLang's DSparkStsCalibration and SpsCostTable JSON
    (speculative/dspark_components/dspark_sts.py:9-14, dspark_sps.py:14-36 of sglang 0.5.23):
    the temperatures one per draft position (dspark_planner.py:107 requires gamma of them), the
    ECE of the calibration.csv beside alg1.json, batch tokens strictly increasing."""
    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    alg1 = _alg1(tmp_path)
    out = export.export_drafter(d, qwen3_target, "deepspec", tmp_path / "s", engine="sglang", sts=alg1, sps=alg1)
    sts = json.loads((out / sglang.SGLANG_STS_FILE).read_text())
    sps = json.loads((out / sglang.SGLANG_SPS_FILE).read_text())
    assert sts == {"temperatures": [0.5 + 0.25 * k for k in range(7)], "dataset": "gsm8k", "num_samples": 40,
                   "ece_before": [0.1 + k / 100 for k in range(1, 8)], "ece_after": [0.05 + k / 200 for k in range(1, 8)]}
    assert sps == {"sample_batch_tokens": [1, 2, 3, 4, 8], "sample_steps_per_sec": [50.0, 49.0, 47.5, 46.0, 40.0],
                   "max_batch_tokens": 8}
    serve = json.loads((out / "config.json").read_text())["deepspec_serve_sglang"]
    assert serve == {"speculative_algorithm": "DSPARK", "speculative_dspark_block_size": 7,
                     "speculative_dspark_confidence_sts_path": "sglang_sts.json",
                     "speculative_dspark_sps_table_path": "sglang_sps.json",
                     "env": {"SGLANG_RAGGED_VERIFY_MODE": "compact"},
                     # E4: SGLang clamps SPS(B) past the table (8 tokens = one request of 8): beyond, its
                     # planner would see free verification and verify everything
                     "max_running_requests": 1}
    short = tmp_path / "short"
    short.mkdir()
    a = json.loads(_alg1(short).read_text())
    a["sps"] = {"batch_tokens": [1, 2, 4], "steps_per_s": [50.0, 49.0, 46.0]}
    (short / "gsm8k.alg1.json").write_text(json.dumps(a))
    _fails_with(d, qwen3_target, tmp_path / "sh", "ends at 4 tokens, short of one request's 8", engine="sglang",
                sps=short / "gsm8k.alg1.json")
    # batch tokens as whole floats (alg1.json written before schedule wrote ints) export as ints; 1.5 does not
    floats = tmp_path / "floats"
    floats.mkdir()
    a["sps"] = {"batch_tokens": [1.0, 2.0, 4.0, 8.0], "steps_per_s": [50.0, 49.0, 46.0, 40.0]}
    (floats / "gsm8k.alg1.json").write_text(json.dumps(a))
    out3 = export.export_drafter(d, qwen3_target, "deepspec", tmp_path / "s3", engine="sglang",
                                 sps=floats / "gsm8k.alg1.json")
    assert json.loads((out3 / sglang.SGLANG_SPS_FILE).read_text())["sample_batch_tokens"] == [1, 2, 4, 8]
    a["sps"]["batch_tokens"][1] = 1.5
    (floats / "gsm8k.alg1.json").write_text(json.dumps(a))
    _fails_with(d, qwen3_target, tmp_path / "fl", "must be increasing integers", engine="sglang",
                sps=floats / "gsm8k.alg1.json")
    bare = tmp_path / "bare"
    bare.mkdir()
    out2 = export.export_drafter(d, qwen3_target, "deepspec", tmp_path / "s2", engine="sglang", sts=_alg1(bare, ece=False))
    assert set(json.loads((out2 / sglang.SGLANG_STS_FILE).read_text())) == {"temperatures", "dataset", "num_samples"}
    assert not (out2 / sglang.SGLANG_SPS_FILE).exists()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    _fails_with(d, qwen3_target, tmp_path / "g", "must be 7 positive numbers", engine="sglang", sts=_alg1(wrong, gamma=5))
    _fails_with(d, qwen3_target, tmp_path / "m", "no such file", engine="sglang", sts=tmp_path / "none.alg1.json")
    _fails_with(d, qwen3_target, tmp_path / "v", "use --format deepspec --engine sglang", engine="vllm", sps=alg1)
    noconf, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3, confidence_head=False)
    _fails_with(noconf, qwen3_target, tmp_path / "n", "no confidence head", engine="sglang", sts=alg1)
    # E6: without a confidence head SGLang must verify statically (its other modes build the head)
    out3 = export.export_drafter(noconf, qwen3_target, "deepspec", tmp_path / "n2", engine="sglang")
    assert json.loads((out3 / "config.json").read_text())["deepspec_serve_sglang"]["env"] == \
        {"SGLANG_RAGGED_VERIFY_MODE": "static"}


def _fails_with(d, target, out, match, fmt="deepspec", **kw):
    with pytest.raises(DeepSpecError, match=match) as ei:
        export.export_drafter(d, target, fmt, out, **kw)
    assert "\n" not in str(ei.value) and not out.exists()


def test_sglang_refusals(qwen3_target, qwen3_cfg, gemma4_target, gemma4_cfg, tmp_path):
    """What SGLang's DSPARK cannot load or would load wrongly (docs/FORMATS.md §1.3)."""
    cases = [(("dflash", qwen3_target, qwen3_cfg), {"mask_token_id": 3}, "DSPARK requires markov_rank > 0"),
             (("dspark", qwen3_target, qwen3_cfg), {"mask_token_id": 3, "draft_vocab_size": 100}, "reduced draft vocab"),
             (("dspark", qwen3_target, qwen3_cfg), {}, "learned mask embedding, which SGLang replaces"),
             (("dspark", gemma4_target, gemma4_cfg), {"mask_token_id": 4}, "Qwen3DSparkModel \\(Qwen3 layers\\) only"),
             (("eagle3", qwen3_target, qwen3_cfg), {}, "SGLang serves Eagle3 from the eagle3 layout")]
    for i, ((method, target, cfg), kw, match) in enumerate(cases):
        d, _ = _drafter(method, target, cfg, **kw)
        _fails_with(d, target, tmp_path / str(i), match, engine="sglang")
    c = copy.deepcopy(qwen3_cfg)
    c["target"]["feature_layers"] = [-1, 1]
    emb, _ = _drafter("dspark", qwen3_target, c, mask_token_id=3)
    _fails_with(emb, qwen3_target, tmp_path / "e", "feature layer -1", engine="sglang")
    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    cfg, sd = deepspec_layout.deepspec_layout(d, qwen3_target, engine="sglang")
    with pytest.raises(DeepSpecError, match="tensor layers.0.self_attn.v_proj.weight: SGLang's Qwen3DSparkModel expects"):
        sglang.check_sglang(cfg, {k: v for k, v in sd.items() if k != "layers.0.self_attn.v_proj.weight"})
    with pytest.raises(DeepSpecError, match="tensor markov.embed.weight"):
        sglang.check_sglang(cfg, dict(sd, **{"markov.embed.weight": sd["markov_head.markov_w1.weight"]}))


# --------------------------------------------------------------------------- the speculators format


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_speculators_export_fields(qwen3_target, qwen3_cfg, method, tmp_path):
    """The fields vLLM 0.32 reads from a speculators-format DSpark (transformers_utils/configs/
    speculators/base.py validate_speculators_config, algos.py update_dspark); the engine-side
    parsing itself is checked in tests/engine/test_speculators.py."""
    d, _ = _drafter(method, qwen3_target, qwen3_cfg, mask_token_id=3)
    out = export.export_drafter(d, qwen3_target, "speculators", tmp_path / "sp", verifier="Qwen/Qwen3-4B")
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["Qwen3DSparkModel"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "dspark" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 7 and sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"] == {"name_or_path": "Qwen/Qwen3-4B", "architectures": ["Qwen3ForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 512
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2] and cfg["sample_from_anchor"] is True
    assert cfg["mask_token_id"] == 3 and cfg["block_size"] == 7 and cfg["draft_vocab_size"] == 512
    assert cfg["markov_rank"] == (1 if method == "dflash" else 32) and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is (method == "dspark")
    ref = deepspec_layout.deepspec_layout(d, qwen3_target, engine="vllm")[1]
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd)
    default = export.export_drafter(d, qwen3_target, "speculators", tmp_path / "sp2")
    assert json.loads((default / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "tiny-qwen3"


def test_a_local_verifier_is_served_explicitly(qwen3_target, qwen3_cfg, tmp_path, caplog):
    """vLLM >= 0.34 refuses `vllm serve DIR` when the speculators verifier is local
    (transformers_utils/config.py: "must name a remote model repository"). The export still
    names it, records the form both 0.32 and 0.34 serve (the target as the model, the
    drafter as its speculative model) and says so in the log; a hub verifier keeps `vllm serve DIR`."""
    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    local = tmp_path / "target"
    local.mkdir()
    with caplog.at_level("INFO", logger="deepspec.formats.export"):
        out = export.export_drafter(d, qwen3_target, "speculators", tmp_path / "sp", verifier=str(local))
    serve = json.loads((out / "config.json").read_text())["deepspec_serve_vllm"]
    assert serve == {"model": str(local), "speculative_config": {"method": "dspark", "num_speculative_tokens": 7,
                                                                 "draft_sample_method": "probabilistic"}}
    assert f"vllm serve {local} --speculative-config" in caplog.text and "refuses" in caplog.text
    hub = export.export_drafter(d, qwen3_target, "speculators", tmp_path / "hub", verifier="Qwen/Qwen3-4B")
    assert "model" not in json.loads((hub / "config.json").read_text())["deepspec_serve_vllm"]
    from deepspec.fetch import not_a_hub_id

    assert [not_a_hub_id(x) for x in ("Qwen/Qwen3-4B", "tiny-qwen3", "./t", "/abs/t", "a/b/c", "a--b")] == \
        [False, False, True, True, True, True]


def test_speculators_refusals(qwen3_target, qwen3_cfg, gemma4_target, gemma4_cfg, tmp_path):
    e3, _ = _drafter("eagle3", qwen3_target, qwen3_cfg)
    _fails_with(e3, qwen3_target, tmp_path / "e", "--format eagle3", fmt="speculators")
    g4, _ = _drafter("dspark", gemma4_target, gemma4_cfg, mask_token_id=4)
    _fails_with(g4, gemma4_target, tmp_path / "g", "Qwen3DSparkModel \\(Qwen3 draft layers\\) only", fmt="speculators")
    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    _fails_with(d, qwen3_target, tmp_path / "s", "read by vLLM, not sglang", fmt="speculators", engine="sglang")
    _fails_with(d, qwen3_target, tmp_path / "v", "--verifier names the target", verifier="x")


def test_out_that_is_contains_or_lies_inside_src_is_refused(qwen3_target, qwen3_cfg, tmp_path, monkeypatch, capsys):
    """--overwrite must never delete the drafter being exported (its checkpoints, logs, summary)."""
    from deepspec.cli import main as cli_main
    from deepspec.targets import loading as target_mod

    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg)
    src = tmp_path / "runs" / "dspark"
    d.save_pretrained(str(src))
    (src / "checkpoints").mkdir()
    (src / "checkpoints" / "step-1.pt").write_bytes(b"ckpt")
    (src / "train_log.csv").write_text("step,loss\n1,2.0\n")
    (src / "train_summary.json").write_text("{}\n")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    monkeypatch.setattr(target_mod, "target_from_config", lambda cfg: qwen3_target)
    for out, how in ((src, "is"), (src / "export", "lies inside"), (tmp_path / "runs", "contains"),
                     (tmp_path / "runs" / "." / "dspark", "is")):
        rc = cli_main(["export-checkpoint", "--preset", "tiny", "--src", str(src), "--format", "deepspec",
                       "--out", str(out), "--overwrite"])
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert rc == 2 and len(err) == 1 and f" {how} --src " in err[0], err
        assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    # an output beside it is fine
    assert cli_main(["export-checkpoint", "--preset", "tiny", "--src", str(src), "--format", "deepspec",
                     "--out", str(tmp_path / "runs" / "dspark-export")]) == 0
    assert (tmp_path / "runs" / "dspark-export" / "model.safetensors").exists()


def test_overwrite_replaces_an_export_not_an_unrelated_folder(qwen3_target, qwen3_cfg, tmp_path, monkeypatch, capsys):
    """X2: --overwrite onto a folder that is not a deepspec output is refused in one line
    and the folder keeps its files; an earlier export is replaced. F4: a disk
    full during the write (safetensors says so in a SafetensorError, not an
    OSError) is one line naming --out, and nothing is left."""
    from deepspec.cli import main as cli_main
    from deepspec.targets import loading as target_mod

    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg)
    d.save_pretrained(str(tmp_path / "src"))
    monkeypatch.setattr(target_mod, "target_from_config", lambda cfg: qwen3_target)
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("precious")
    (victim / "sub" / "data.csv").write_text("data")
    base = ["export-checkpoint", "--preset", "tiny", "--src", str(tmp_path / "src"), "--format", "deepspec", "--overwrite"]
    assert cli_main(base + ["--out", str(victim)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"deepspec export-checkpoint: error: output {victim} is not an output directory deepspec wrote "
                       f"(no {OUTPUT_MARKER} in it): --overwrite replaces only deepspec's own outputs; remove it "
                       "yourself or choose another output")
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == ["notes.txt", "sub", "sub/data.csv"]
    out = tmp_path / "exp"
    assert cli_main(base + ["--out", str(out)]) == 0
    (out / "model.safetensors").write_bytes(b"old")
    assert cli_main(base + ["--out", str(out)]) == 0 and (out / "model.safetensors").stat().st_size > 1000

    def full(*args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    capsys.readouterr()
    assert cli_main(base + ["--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"deepspec export-checkpoint: error: disk full writing {tmp_path / 'full'} (No space left on "
                       "device); nothing half-written was kept: free space and rerun")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "src", "victim"]


def test_cli_passes_engine_files_and_verifier(qwen3_target, qwen3_cfg, tmp_path, monkeypatch):
    """export-checkpoint's --engine sglang --sts/--sps and --format speculators --verifier reach the export."""
    from deepspec.cli import main as cli_main
    from deepspec.targets import loading as target_mod

    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    d.save_pretrained(str(tmp_path / "src"))
    monkeypatch.setattr(target_mod, "target_from_config", lambda cfg: qwen3_target)
    alg1 = _alg1(tmp_path)
    base = ["export-checkpoint", "--preset", "tiny", "--set", f"results_dir={tmp_path / 'results'}",
            "--src", str(tmp_path / "src")]
    assert cli_main(base + ["--format", "deepspec", "--engine", "sglang", "--sts", str(alg1), "--sps", str(alg1),
                            "--out", str(tmp_path / "sg")]) == 0
    assert {p.name for p in (tmp_path / "sg").iterdir()} == {"config.json", "model.safetensors", "sglang_sts.json",
                                                             "sglang_sps.json", "README.md", OUTPUT_MARKER}
    assert cli_main(base + ["--format", "speculators", "--verifier", "Qwen/Qwen3-4B", "--out", str(tmp_path / "sp")]) == 0
    cfg = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-4B"


def test_an_export_carries_a_model_card_to_publish(qwen3_target, qwen3_cfg, tmp_path, monkeypatch):
    """export-checkpoint writes README.md: the hub's metadata (base model, library, tags),
    the serving command per engine, the acceptance this run measured (ours per benchmark,
    vLLM's from serve-check), the training recipe and the provenance, which is copied in;
    what the run has not measured is said to be missing."""
    from deepspec.cli import main as cli_main
    from deepspec.config import load_config
    from deepspec.paths import RunPaths
    from deepspec.targets import loading as target_mod

    d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3)
    src = tmp_path / "src"
    d.save_pretrained(str(src))
    (src / "train_summary.json").write_text(json.dumps({
        "steps": 600, "elapsed_s": 415.0, "train": {"lr": {"dspark": 2.4e-3}, "global_batch": 4, "num_anchors": 16,
                                                     "warmup_ratio": 0.04, "seed": 42},
        "precision": {"mixed_precision": "bf16"}, "code": {"commit": "abc123", "dirty": False}}))
    monkeypatch.setattr(target_mod, "target_from_config", lambda cfg: qwen3_target)
    results = tmp_path / "results"
    base = ["export-checkpoint", "--preset", "tiny", "--set", f"results_dir={results}", "--src", str(src)]
    assert cli_main(base + ["--format", "deepspec", "--engine", "vllm", "--out", str(tmp_path / "bare")]) == 0
    card = (tmp_path / "bare" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: vllm\n") and "base_model" not in card.split("---")[1]  # tiny-qwen3: no hub id
    assert "Not measured yet" in card and "- steps: 600" in card and "- learning rate: 0.0024" in card
    assert "vllm serve <target> --speculative-config" in card and '"model": "<this directory>"' in card

    paths = RunPaths.of(load_config("tiny", {"results_dir": str(results)}))
    summary = {"domain": "Math", "tau": 1.42, "tau_ci_low": 1.35, "tau_ci_high": 1.5, "temperature": 1.0,
               "max_new_tokens": 64, "speedup_vs_plain": 0.93,
               "positions": [{"position": k, "acceptance": 0.5, "acceptance_rb": [0.31, 0.35, 0.36][k - 1]}
                             for k in (1, 2, 3)]}
    paths.summary("dspark", "gsm8k").parent.mkdir(parents=True)
    paths.summary("dspark", "gsm8k").write_text(json.dumps(summary))
    paths.serve_check("dspark").parent.mkdir(parents=True)
    paths.serve_check("dspark").write_text(json.dumps({"vllm_version": "0.32.0", "passed": True, "greedy": {
        "lossless": True, "tau_vllm": 1.4, "tau_deepspec": 1.4}}))
    paths.provenance().write_text(json.dumps({"packages": {"torch": "2.13.0"}, "target": {"spec": "tiny-qwen3"}}))
    monkeypatch.setattr(qwen3_target, "target_id", "Qwen/Qwen3-4B")
    d.config.deepspec_target_id = "Qwen/Qwen3-4B"
    d.save_pretrained(str(src))
    assert cli_main(base + ["--format", "speculators", "--out", str(tmp_path / "pub")]) == 0
    card = (tmp_path / "pub" / "README.md").read_text()
    meta = card.split("---")[1]
    assert "base_model: Qwen/Qwen3-4B" in meta and "library_name: speculators" in meta and "- dspark" in meta
    assert "| gsm8k | Math | 1.42 [1.35, 1.50] | 0.310 | 0.350 | 0.360 | 0.93x |" in card
    assert "Served in vLLM 0.32.0 (serve-check, the same prompts): passed" in card
    assert "vllm serve <this directory> --speculative-config" in card and "torch 2.13.0" in card
    assert (tmp_path / "pub" / "provenance.json").exists() and "Not measured yet" not in card


# SGLang 0.5.23's server flags our SGLang commands use: "--" + a ServerArgs field with "_" as "-"
# (srt/arg_groups/arg_utils.py:_field_to_cli_name), the fields read in srt/arg_groups/fields/model.py
# (model_path), schedule.py (max_running_requests) and spec.py (speculative_*); its verify mode is the
# environment variable SGLANG_RAGGED_VERIFY_MODE (srt/environ.py, default "static"; ragged_verify.py:
# static | cap-accept | compact; models/dspark.py builds the confidence head in every mode but static).
SGLANG_0_5_23_FLAGS = {"--model-path", "--max-running-requests", "--speculative-algorithm",
                       "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
                       "--speculative-num-draft-tokens", "--speculative-dspark-block-size",
                       "--speculative-dspark-sps-table-path", "--speculative-dspark-confidence-sts-path"}


def _card_command(card: str, engine: str) -> list[str]:
    """The card's one-line command for `engine`, its placeholder for the export's path
    (`<this directory>`, which the reader replaces) read as one word, DIR."""
    import shlex

    block = card.split(f"\n{engine}:\n\n```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in block
    return shlex.split(block.replace("<this directory>", "DIR"))


def _sglang_parts(cmd: list[str]):
    """(environment, launcher, {flag: value}) of an SGLang command line."""
    env = dict(x.split("=", 1) for x in cmd[:cmd.index("python")])
    launcher, args = cmd[len(env):len(env) + 3], cmd[len(env) + 3:]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return env, launcher, dict(zip(args[::2], args[1::2]))


def test_the_model_cards_sglang_command_is_what_the_sglang_export_needs(qwen3_target, qwen3_cfg, tmp_path,
                                                                         monkeypatch):
    """The card's SGLang command serves the export as SGLang 0.5.23 must be told to: its
    launcher with the target and the export, DSPARK at the drafter's block size, only flags
    SGLang declares, the STS/SPS files the export holds (by path: SGLang reads them as given)
    with the compact ragged verify mode that reads them and the request cap their table
    spans; a drafter without a confidence head with SGLANG_RAGGED_VERIFY_MODE=static (its
    other modes build the head and fail on its missing weights)."""
    import shlex

    from deepspec.cli import main as cli_main
    from deepspec.targets import loading as target_mod

    monkeypatch.setattr(target_mod, "target_from_config", lambda cfg: qwen3_target)
    monkeypatch.setattr(qwen3_target, "target_id", "Qwen/Qwen3-4B")
    alg1 = _alg1(tmp_path)
    for name, kw in (("scheduled", {}), ("headless", {"confidence_head": False})):
        d, _ = _drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3, **kw)
        d.config.deepspec_target_id = "Qwen/Qwen3-4B"
        d.save_pretrained(str(tmp_path / f"src-{name}"))
        out = tmp_path / name
        files = ["--sts", str(alg1), "--sps", str(alg1)] if name == "scheduled" else []
        assert cli_main(["export-checkpoint", "--preset", "tiny", "--set", f"results_dir={tmp_path / 'results'}",
                         "--src", str(tmp_path / f"src-{name}"), "--format", "deepspec", "--engine", "sglang",
                         *files, "--out", str(out)]) == 0
        cfg = json.loads((out / "config.json").read_text())
        card = (out / "README.md").read_text()
        env, launcher, flags = _sglang_parts(_card_command(card, "sglang"))
        # the written config's settings give the same command (in the order its keys were written)
        assert _sglang_parts(shlex.split(export.serve_commands(cfg, out, "Qwen/Qwen3-4B")["sglang"].replace(
            str(out), "DIR"))) == (env, launcher, flags)
        assert launcher == ["python", "-m", "sglang.launch_server"]
        assert set(flags) <= SGLANG_0_5_23_FLAGS, set(flags) - SGLANG_0_5_23_FLAGS
        assert flags["--model-path"] == "Qwen/Qwen3-4B" and flags["--speculative-draft-model-path"] == "DIR"
        assert flags["--speculative-algorithm"] == "DSPARK"
        assert flags["--speculative-dspark-block-size"] == str(cfg["block_size"]) == "7"
        if name == "scheduled":
            assert env == {"SGLANG_RAGGED_VERIFY_MODE": "compact"} and cfg["enable_confidence_head"] is True
            for flag, file in (("--speculative-dspark-confidence-sts-path", sglang.SGLANG_STS_FILE),
                               ("--speculative-dspark-sps-table-path", sglang.SGLANG_SPS_FILE)):
                assert flags[flag] == f"DIR/{file}" and (out / file).is_file()
            table = json.loads((out / sglang.SGLANG_SPS_FILE).read_text())
            assert flags["--max-running-requests"] == str(table["max_batch_tokens"] // (cfg["block_size"] + 1))
        else:
            assert env == {"SGLANG_RAGGED_VERIFY_MODE": "static"} and cfg["enable_confidence_head"] is False
            assert set(flags) == {"--model-path", "--speculative-draft-model-path", "--speculative-algorithm",
                                  "--speculative-dspark-block-size"}


# --------------------------------------------------------------------------- DeepSeek's released Eagle3 layout


def released_eagle3(target, layer_ids, path, *, n_layers=1, seed=0, dtype=torch.bfloat16):
    """A synthetic checkpoint in DeepSeek's Qwen3Eagle3Model / Gemma4Eagle3Model layout,
    from the documented names and shapes (docs/FORMATS.md), random weights."""
    tc = target.config.get_text_config()
    gemma4 = tc.model_type == "gemma4_text"
    d, H = tc.hidden_size, tc.num_attention_heads
    if gemma4:
        full = tc.per_layer_config["full_attention"]
        hd, Hkv = full.head_dim, full.num_key_value_heads
    else:
        hd, Hkv = tc.head_dim, tc.num_key_value_heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape, one=False):
        x = torch.randn(*shape, generator=g) * (0.3 if one else shape[-1] ** -0.5)
        return (x + 1.0 if one else x).to(dtype)

    sd = {"fc.weight": w(d, len(layer_ids) * d), "norm.weight": w(d, one=True),
          "embed_tokens.weight": target.embed_tokens.weight.detach().to(dtype),
          "lm_head.weight": target.lm_head.weight.detach().to(dtype)}
    for i in range(n_layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": w(H * hd, 2 * d), p + "self_attn.k_proj.weight": w(Hkv * hd, 2 * d),
                   p + "self_attn.o_proj.weight": w(d, H * hd), p + "self_attn.q_norm.weight": w(hd, one=True),
                   p + "self_attn.k_norm.weight": w(hd, one=True), p + "hidden_norm.weight": w(d, one=True),
                   p + "input_layernorm.weight": w(d, one=True), p + "post_attention_layernorm.weight": w(d, one=True),
                   p + "mlp.gate_proj.weight": w(tc.intermediate_size, d), p + "mlp.up_proj.weight": w(tc.intermediate_size, d),
                   p + "mlp.down_proj.weight": w(d, tc.intermediate_size)})
        if not (gemma4 and tc.attention_k_eq_v):
            sd[p + "self_attn.v_proj.weight"] = w(Hkv * hd, 2 * d)
        if gemma4:
            sd.update({p + "pre_feedforward_layernorm.weight": w(d, one=True),
                       p + "post_feedforward_layernorm.weight": w(d, one=True), p + "layer_scalar": w(1, one=True)})
    cfg = dict(tc.to_dict(), architectures=["Gemma4Eagle3Model" if gemma4 else "Qwen3Eagle3Model"],
               num_target_layers=target.num_layers, num_hidden_layers=n_layers, target_layer_ids=list(layer_ids),
               ttt_length=7, step_loss_decay=0.8, draft_num_hidden_layers=n_layers, tie_word_embeddings=False)
    if gemma4:
        cfg.pop("per_layer_config", None)
        cfg.update(global_head_dim=hd, num_global_key_value_heads=Hkv)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return path, {k: v.float() for k, v in sd.items()}


@pytest.mark.parametrize("kind,n_layers", [("qwen3", 1), ("qwen3", 2), ("gemma4", 1)])
def test_released_eagle3_layout_converts_to_the_equations(kind, n_layers, request, tmp_path):
    target = request.getfixturevalue(f"{kind}_target")
    cfg = request.getfixturevalue(f"{kind}_cfg")
    layers = cfg["target"]["feature_layers"]
    src, W = released_eagle3(target, layers, tmp_path / "ref", n_layers=n_layers)
    e = load_drafter(convert.convert_reference_checkpoint(src, target, tmp_path / "out"), target)
    assert e.method == "eagle3" and e.config.num_hidden_layers == n_layers and e.gamma == 7
    ids, f = _batch(target, cfg)
    with torch.no_grad():
        ours = e(ids, f, steps=3)
        ref = plain_ttt(e, W, ids, f, 3, kind, target.embed_tokens)
    for a, b in zip(ours, ref):
        assert (a - b).abs().max() < 2e-4 * max(1.0, b.abs().max())


def test_released_eagle3_for_another_target_is_refused(qwen3_target, qwen3_cfg, tmp_path):
    src, _ = released_eagle3(qwen3_target, qwen3_cfg["target"]["feature_layers"], tmp_path / "ref")
    sd = load_file(str(src / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(DeepSpecError, match="lm_head.weight differs"):
        convert.convert_reference_checkpoint(src, qwen3_target, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gemma4_export_reads_per_layer_as_vllm_034_does(gemma4_target, gemma4_cfg, tmp_path):
    """E7: vLLM 0.34's Gemma4 DSpark attention (model_executor/models/gemma4_dspark.py:55-57)
    sizes each draft layer from `config.per_layer_config[i]` (head_dim, num_key_value_heads),
    transformers' per-layer view of the config. On our export every layer's view matches the
    exported q/k projections (the draft layers are full attention with the global geometry)."""
    from transformers import AutoConfig

    d, _ = _drafter("dspark", gemma4_target, gemma4_cfg, mask_token_id=4)
    out = export.export_drafter(d, gemma4_target, "deepspec", tmp_path / "g4", engine="vllm")
    sd = load_file(str(out / "model.safetensors"))
    conf = AutoConfig.from_pretrained(str(out))
    for i in range(conf.num_hidden_layers):
        layer = conf.per_layer_config[i]
        assert sd[f"layers.{i}.self_attn.k_proj.weight"].shape[0] == layer.num_key_value_heads * layer.head_dim
        assert sd[f"layers.{i}.self_attn.q_proj.weight"].shape[0] == conf.num_attention_heads * layer.head_dim

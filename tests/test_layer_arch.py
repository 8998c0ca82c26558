"""drafter.layer_arch: draft layers of another architecture than the target's
(Qwen3 layers over the tiny Llama target, the layer vLLM serves DFlash/DSpark
through): the config made from the target's sizes, a training step, save/load,
proposals through the batched engine, the refusal of a drafter whose layers the
config does not build, the schema key and its fingerprint, plan-time refusal
over Gemma4, and the vLLM export (Qwen3DSparkModel) converted back."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config import load_config, settings_fingerprint
from deepspec.core.decode import plain_generate
from deepspec.core.engine import BatchedEngine, Request
from deepspec.drafters import build_drafter, draft_config, load_drafter
from deepspec.errors import DeepSpecError
from deepspec.formats import convert, export
from deepspec.planning.preflight import preflight
from deepspec.training.run import step_spec

from helpers import PROMPT

SEQ = [1, 2, 3, 500, 17, 923, 4411, 60, 7, 311, 2999, 12, 40, 5, 88, 1024]
# the fields of a Qwen3 draft config that must be the target's
SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
         "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act")


def _cfg(cfg, **drafter):
    c = copy.deepcopy(cfg)
    c["drafter"].update(drafter)
    return c


def _qwen3(method, target, cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return build_drafter(method, target, _cfg(cfg, layer_arch="qwen3", **kw)).eval()


@pytest.fixture(scope="module")
def batch(tiny_target, tiny_cfg):
    ids = torch.tensor([SEQ])
    feats, last = tiny_target.features(ids, tiny_cfg["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    return dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_qwen3_layers_over_a_llama_target_have_its_sizes(tiny_target, tiny_cfg, method):
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3

    tc = tiny_target.text_config
    assert tc.model_type == "llama"
    d = _qwen3(method, tiny_target, tiny_cfg)
    c = d.config
    assert type(c) is Qwen3Config and c.model_type == "qwen3"
    for key in SIZES:
        assert getattr(c, key) == getattr(tc, key), key
    assert c.num_hidden_layers == tiny_cfg["drafter"]["num_layers"][method]
    assert c.layer_types == ["full_attention"] * c.num_hidden_layers and not c.use_sliding_window
    for layer in d.layers:
        a = layer.self_attn
        assert isinstance(a, modeling_qwen3.Qwen3Attention)
        assert a.q_norm.weight.shape == a.k_norm.weight.shape == (tc.head_dim,)
    assert isinstance(d.norm, modeling_qwen3.Qwen3RMSNorm)
    # without the key, the same target builds Llama layers
    assert build_drafter(method, tiny_target, tiny_cfg).config.model_type == "llama"


def test_qwen3_layers_over_a_qwen3_target_are_the_target_layers(qwen3_target, qwen3_cfg):
    for method in ("eagle3", "dspark"):
        layers = qwen3_cfg["target"]["feature_layers"]
        a = draft_config(method, qwen3_target, _cfg(qwen3_cfg, layer_arch="qwen3")["drafter"], layers).to_dict()
        b = draft_config(method, qwen3_target, qwen3_cfg["drafter"], layers).to_dict()
        assert a == b


PROMPTS = [PROMPT, [591, 2293] + PROMPT]


@pytest.fixture(scope="module")
def plain_greedy(tiny_target):
    return [plain_generate(tiny_target, p, max_new_tokens=8, temperature=0.0).tokens for p in PROMPTS]


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_qwen3_layer_drafter_trains_saves_loads_and_proposes(tiny_target, tiny_cfg, batch, plain_greedy, tmp_path,
                                                             method):
    cfg = _cfg(tiny_cfg, layer_arch={method: "qwen3"})
    torch.manual_seed(0)
    d = build_drafter(method, tiny_target, cfg).train()
    assert d.config.model_type == "qwen3"
    loss, m = d.training_step(batch, step_spec(cfg), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and 0.0 <= m["c_star_1"] <= 1.0
    loss.backward()
    grads = dict(d.named_parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in grads.values())
    assert grads["layers.0.self_attn.q_norm.weight"].grad.abs().sum() > 0  # Qwen3's q/k norms are trained
    assert grads["layers.0.self_attn.k_norm.weight"].grad.abs().sum() > 0
    torch.optim.SGD(d.parameters(), lr=0.1).step()  # norms away from their init of ones

    d.eval().save_pretrained(tmp_path / "d")
    e = load_drafter(tmp_path / "d", tiny_target, cfg["drafter"])
    assert type(e) is type(d) and type(e.config) is type(d.config) and e.config.model_type == "qwen3"
    sd, se = d.state_dict(), e.state_dict()
    assert sd.keys() == se.keys() and all(torch.equal(sd[k], se[k]) for k in sd)
    ids, f = batch["input_ids"], batch["features"]
    with torch.no_grad():
        a, b = (d(ids, f, steps=2)[-1], e(ids, f, steps=2)[-1]) if method == "eagle3" else \
            (d(ids, f, torch.tensor([[4, 9]])), e(ids, f, torch.tensor([[4, 9]])))
    assert torch.equal(d.draft_logits(a), e.draft_logits(b))

    g = e.gamma
    prop = e.propose(e.init_state(), f[:, :8], ids[:, :9], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert prop.tokens.shape == (1, g) and prop.probs.shape == (1, g, tiny_target.vocab_size)
    assert torch.allclose(prop.probs.sum(-1), torch.ones(1, g), atol=1e-5)
    assert (prop.conf_logits is not None) == (method == "dspark")
    # the batched engine (evaluate) with this drafter: greedy decoding is the target's
    eng = BatchedEngine(tiny_target, e, feature_layers=tiny_cfg["target"]["feature_layers"], temperature=0.0,
                        max_batch=2)
    got = {f.request.request_id: f for f in eng.generate([Request(i, p, 8) for i, p in enumerate(PROMPTS)])}
    assert [got[i].tokens for i in range(len(PROMPTS))] == plain_greedy


def test_load_refuses_a_drafter_of_other_layers(tiny_target, tiny_cfg, tmp_path):
    _qwen3("dspark", tiny_target, tiny_cfg).save_pretrained(tmp_path / "q")
    build_drafter("dflash", tiny_target, tiny_cfg).save_pretrained(tmp_path / "l")
    for path, drafter_cfg, have, arch, want in [
        ("q", tiny_cfg["drafter"], "qwen3", "target", "llama"),
        ("q", _cfg(tiny_cfg, layer_arch={"dflash": "qwen3"})["drafter"], "qwen3", "target", "llama"),
        ("l", _cfg(tiny_cfg, layer_arch="qwen3")["drafter"], "llama", "qwen3", "qwen3"),
    ]:
        with pytest.raises(DeepSpecError) as e:
            load_drafter(tmp_path / path, tiny_target, drafter_cfg)
        msg = str(e.value)
        assert "\n" not in msg and f"has {have} draft layers" in msg and f"layer_arch {arch!r} builds {want}" in msg
    # the config that built them loads them; without a config nothing is checked
    assert load_drafter(tmp_path / "q", tiny_target, _cfg(tiny_cfg, layer_arch={"dspark": "qwen3"})["drafter"])
    assert load_drafter(tmp_path / "l", tiny_target, tiny_cfg["drafter"])
    assert load_drafter(tmp_path / "q", tiny_target).config.model_type == "qwen3"


def test_qwen3_layers_are_refused_over_gemma4(gemma4_target, gemma4_cfg):
    with pytest.raises(DeepSpecError, match="layer_arch 'qwen3' over a gemma4_text target"):
        build_drafter("dspark", gemma4_target, _cfg(gemma4_cfg, layer_arch="qwen3"))
    # at plan time, from the target's shipped facts
    with pytest.raises(DeepSpecError, match="dspark drafter: drafter.layer_arch 'qwen3' over a gemma4"):
        preflight(load_config("gemma4-12b", {"drafter": {"layer_arch": {"dspark": "qwen3"}}}))
    preflight(load_config("gemma4-12b", {"drafter": {"layer_arch": {"dspark": "target"}}}))
    preflight(load_config("tiny", {"drafter": {"layer_arch": "qwen3"}}))


def test_the_schema_key(tiny_cfg):
    assert load_config("tiny")["drafter"]["layer_arch"] == "target"
    assert load_config("tiny", {"drafter": {"layer_arch": "qwen3"}})["drafter"]["layer_arch"] == "qwen3"
    for bad in ("llama", {"dspak": "qwen3"}, {"dspark": "llama"}, ["qwen3"]):
        with pytest.raises(DeepSpecError, match="drafter.layer_arch") as e:
            load_config("tiny", {"drafter": {"layer_arch": bad}})
        assert "\n" not in str(e.value)
    # a changed layer choice reruns training (and what follows it), not regeneration
    a = load_config("tiny")
    b = load_config("tiny", {"drafter": {"layer_arch": {"dspark": "qwen3"}}})
    assert settings_fingerprint(a, "train") != settings_fingerprint(b, "train")
    assert settings_fingerprint(a, "regenerate") == settings_fingerprint(b, "regenerate")


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_export_of_qwen3_layers_over_llama_and_back(tiny_target, tiny_cfg, batch, tmp_path, method):
    """The export vLLM serves (Qwen3DSparkModel, the Qwen3 layer's tensors) of a
    drafter over a Llama target, and its conversion back: the same function."""
    d = _qwen3(method, tiny_target, tiny_cfg, mask_token_id=11)
    with torch.no_grad():  # q/k norms away from ones, so that they must travel
        for n, p in d.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    out = export.export_drafter(d, tiny_target, "deepspec", tmp_path / "vllm", engine="vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    for key in SIZES:
        assert cfg[key] == getattr(tiny_target.text_config, key), key
    sd = load_file(str(out / "model.safetensors"))
    for i in range(d.config.num_hidden_layers):
        assert torch.equal(sd[f"layers.{i}.self_attn.q_norm.weight"], d.layers[i].self_attn.q_norm.weight)
    assert torch.equal(sd["embed_tokens.weight"], tiny_target.embed_tokens.weight)
    # a Llama-layer drafter has no DeepSpec class to be exported as
    with pytest.raises(DeepSpecError, match="a llama drafter as deepspec"):
        export.export_drafter(build_drafter(method, tiny_target, tiny_cfg), tiny_target, "deepspec", tmp_path / "x")
    assert convert.reference_layer_arch(cfg, tiny_target) == "qwen3"
    e = load_drafter(convert.convert_reference_checkpoint(out, tiny_target, tmp_path / "back"), tiny_target,
                     _cfg(tiny_cfg, layer_arch="qwen3")["drafter"])
    assert e.config.model_type == "qwen3"
    s0, s1 = d.state_dict(), e.state_dict()
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    ids, f = batch["input_ids"], batch["features"]
    with torch.no_grad():
        assert torch.equal(d(ids, f, torch.tensor([[4, 9]])), e(ids, f, torch.tensor([[4, 9]])))


def test_report_names_the_draft_layers():
    from deepspec.reporting.report import _draft_layers
    from deepspec.settings import Settings

    assert _draft_layers(Settings.of(load_config("tiny"))) == "draft layers: the target's layer type"
    mixed = Settings.of(load_config("tiny", {"drafter": {"layer_arch": {"dflash": "qwen3", "dspark": "qwen3"}}}))
    assert _draft_layers(mixed) == "draft layers: eagle3: the target's layer type; dflash, dspark: Qwen3 layers"


@pytest.mark.parametrize("preset", ["smollm2-135m", "smollm2-135m-full"])
def test_smollm2_presets_draft_block_drafters_with_qwen3_layers(preset):
    """The CPU presets' DFlash/DSpark use the layer vLLM serves (docs/RESULTS.md: no
    acceptance cost measured); Eagle3 keeps the target's Llama layer."""
    from deepspec.architectures import draft_model_type, layer_arch_of

    d = load_config(preset)["drafter"]
    got = {m: draft_model_type("llama", layer_arch_of(d, m)) for m in ("eagle3", "dflash", "dspark")}
    assert got == {"eagle3": "llama", "dflash": "qwen3", "dspark": "qwen3"}

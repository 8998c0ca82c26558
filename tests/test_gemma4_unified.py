"""The gemma4-12b target's text model, transformers' gemma4_unified_text
(google/gemma-4-12B-it): the drafters are built from its own classes, train,
and convert-checkpoint / plan / preflight accept it; unknown text model types
stop at plan time with one line."""
import copy

import pytest
import torch
import transformers
from transformers.models.gemma4_unified import modeling_gemma4_unified as g4u

from deepspec.config import load_config
from deepspec.core.target import Target, eos_ids_of
from deepspec.drafters import build_drafter
from deepspec.drafters.blocks import blocks_for
from deepspec.errors import DeepSpecError
from deepspec.formats import convert
from deepspec.planning import preflight as pf
from deepspec.targets import specs as target_facts
from deepspec.targets.tiny import build_tiny
from deepspec.training.run import step_spec

SEQ = [2, 17, 300, 45, 9, 230, 77, 410, 5, 61, 128, 333, 12, 90, 499, 3]


@pytest.fixture(scope="module")
def unified_target():
    model = build_tiny("gemma4_unified").eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id="tiny-gemma4-unified", eos_token_ids=eos_ids_of(model, None))


@pytest.fixture(scope="module")
def unified_cfg(gemma4_cfg):
    c = copy.deepcopy(gemma4_cfg)
    c["drafter"]["num_layers"] = {"eagle3": 1, "dflash": 2, "dspark": 2}
    return c


def test_tiny_unified_target_is_the_gemma4_12b_text_model(unified_target):
    assert isinstance(unified_target.model, transformers.Gemma4UnifiedForCausalLM)
    assert unified_target.config.model_type == "gemma4_unified_text"
    b = blocks_for(unified_target.config)
    assert (b.Attention, b.MLP, b.RMSNorm, b.RotaryEmbedding, b.DecoderLayer, b.family) == (
        g4u.Gemma4UnifiedTextAttention, g4u.Gemma4UnifiedTextMLP, g4u.Gemma4UnifiedRMSNorm,
        g4u.Gemma4UnifiedTextRotaryEmbedding, g4u.Gemma4UnifiedTextDecoderLayer, "gemma4")


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_every_drafter_builds_trains_and_converts(unified_target, unified_cfg, method, tmp_path):
    t, c = unified_target, unified_cfg
    torch.manual_seed(0)
    d = build_drafter(method, t, c).train()
    assert d.config.model_type == "gemma4_unified_text" and d.config.head_dim == 32  # global_head_dim
    ids = torch.tensor([SEQ])
    feats, last = t.features(ids, c["target"]["feature_layers"])
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    batch = dict(input_ids=ids, loss_mask=lm, attention_mask=torch.ones_like(lm), features=feats, last_hidden=last)
    loss, _ = d.training_step(batch, step_spec(c), torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in d.parameters() if p.requires_grad)
    ref = dict(d.config.to_dict(), num_target_layers=t.num_layers, target_layer_ids=c["target"]["feature_layers"])
    for mt in ("gemma4_unified_text", "gemma4_text", "gemma4"):  # a checkpoint made for either Gemma4 text model
        convert.check_reference_target(dict(ref, model_type=mt), t, "ckpt", config=d.config)
    with pytest.raises(DeepSpecError, match="a qwen3 drafter, the target 'tiny-gemma4-unified' is gemma4_unified_text"):
        convert.check_reference_target(dict(ref, model_type="qwen3"), t, "ckpt", config=d.config)


def test_plan_builds_the_real_text_model_type():
    facts, _ = target_facts.load_facts(load_config("gemma4-12b"))
    assert type(target_facts.target_config(facts)).__name__ == "Gemma4UnifiedTextConfig"
    with pytest.raises(DeepSpecError, match="unsupported target architecture 'mamba'") as e:
        target_facts.target_config({"model_type": "mamba", "hidden_size": 8})
    assert "\n" not in str(e.value)


def test_preflight_refuses_an_unknown_text_model_type(tmp_path, monkeypatch):
    cfg = load_config("tiny", {"resources_dir": str(tmp_path / "resources")})  # no prepared checkpoint to read
    monkeypatch.setattr(target_facts, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(target_facts, "FACTS_DIR", tmp_path / "config" / "targets")
    (tmp_path / "config" / "targets").mkdir(parents=True)
    (tmp_path / "config" / "targets" / f"{cfg['target']['name']}.json").write_text(
        '{"model_type": "x", "text_config": {"model_type": "mamba", "num_hidden_layers": 4}}')
    with pytest.raises(DeepSpecError, match=r"target 'tiny' \(.*\): unsupported target architecture 'mamba'"):
        pf.preflight(cfg)


def test_tiny_specs_are_known_at_plan_time():
    from deepspec.targets.tiny import TINY_SPECS

    want = {"tiny": ("llama", 2), "tiny-qwen3": ("qwen3", 3), "tiny-gemma4-unified": ("gemma4_unified_text", 4)}
    for spec in TINY_SPECS:
        c = target_facts.text_dims(load_config("tiny", {"target": {"spec": spec, "name": "t"}}))
        assert (c["model_type"], c["num_hidden_layers"]) == want[spec]
    cfg = load_config("tiny", {"target": {"spec": "tiny-gemma4-unified", "feature_layers": [0, 1, 2]}})
    pf.preflight(cfg)
    facts, _ = target_facts.load_facts(cfg)
    assert facts["model_type"] == "gemma4_unified_text" and facts["vocab_size"] == 49152


def test_tiny_unified_spec_prepares_and_loads(tmp_path):
    """`target.spec: tiny-gemma4-unified` is prepared like `tiny` (SmolLM2's tokenizer)."""
    from deepspec.targets.loading import load_target, prepare_target

    out = prepare_target("tiny-gemma4-unified", tmp_path / "t")
    t = load_target("tiny-gemma4-unified", path=out)
    assert isinstance(t.model, transformers.Gemma4UnifiedForCausalLM) and t.tokenizer is not None
    assert (t.num_layers, t.vocab_size) == (4, len(t.tokenizer))
    t.check_feature_layers([0, 1, 2])


def test_export_for_vllm_and_convert_back(unified_target, unified_cfg, tmp_path):
    from deepspec.drafters import load_drafter
    from deepspec.formats import export

    c = copy.deepcopy(unified_cfg)
    c["drafter"]["mask_token_id"] = 4
    torch.manual_seed(0)
    d = build_drafter("dspark", unified_target, c).eval()
    out = export.export_drafter(d, unified_target, "deepspec", tmp_path / "ref", engine="vllm")
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4DSparkModel"] and cfg["attention_k_eq_v"] is True
    e = load_drafter(convert.convert_reference_checkpoint(out, unified_target, tmp_path / "back"), unified_target)
    sd0, sd1 = d.state_dict(), e.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)

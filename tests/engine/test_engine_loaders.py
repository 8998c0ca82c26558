"""vLLM's own loader on our `--format deepspec --engine vllm` exports (vLLM 0.32):
the speculative config `vllm serve` builds for method "dspark", the model class its
registry picks, `load_weights` on our safetensors, then the CPU loader's
post-processing; every parameter vLLM holds must equal our tensor bit for bit and
the settings it read (mask token, block size, feature layers, Markov and confidence
heads, the anchor-first block) must be ours. Runs deepspec/interop/vllm_loadcheck.py
with DEEPSPEC_VLLM_PYTHON (tests/engine/conftest.py)."""
import pytest
import torch

from deepspec.interop import export
from loadcheck_helpers import assert_export_is_the_drafter, assert_loaded_bit_for_bit, drafter, run_loadcheck, vllm_target

CASES = {  # name: (method, drafter settings)
    "dspark": ("dspark", {"mask_token_id": 3}),
    "dspark-confidence-without-markov": ("dspark", {"mask_token_id": 5, "confidence_with_markov": False}),
    "dspark-reduced-vocab": ("dspark", {"mask_token_id": 3, "draft_vocab_size": 300}),
    "dflash": ("dflash", {"mask_token_id": 7}),  # the null Markov head (export.NULL_MARKOV_RANK)
}


@pytest.fixture(scope="module")
def loaded(vllm_python, qwen3_cfg, tmp_path_factory):
    where = tmp_path_factory.mktemp("vllm-loaders")
    target, target_dir = vllm_target(where / "target")
    drafters, cases = {}, []
    for name, (method, settings) in CASES.items():
        d = drafter(method, target, qwen3_cfg, **settings)
        if d.reduced_vocab:  # the draft vocabulary: the 300 highest ids, in draft order
            d.set_draft_vocab(torch.arange(target.vocab_size).flip(0).float())
        out = export.export_drafter(d, target, "deepspec", where / name, engine="vllm")
        assert_export_is_the_drafter(out, d, target)
        drafters[name] = d
        cases.append({"name": name, "draft": str(out), "target": str(target_dir)})
    return drafters, run_loadcheck(vllm_python, cases, where), qwen3_cfg


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_loads_our_export_bit_for_bit(loaded, name):
    drafters, results, cfg = loaded
    d, res = drafters[name], results[name]
    assert_loaded_bit_for_bit(res, {"lm_head.weight", "model.markov_head.markov_w2.weight"} if d.reduced_vocab else set())
    s = res["settings"]
    assert s["method"] == "dspark" and s["architectures"] == ["Qwen3DSparkModel"]
    assert s["model_class"] == "Qwen3DSparkForCausalLM" and s["dtype"] == "torch.float32"
    assert s["num_speculative_tokens"] == s["block_size"] == d.gamma == 7
    assert s["mask_token_id"] == s["model_mask_token_id"] == d.config.deepspec_mask_token_id
    feats = cfg["target"]["feature_layers"]
    assert s["target_layer_ids"] == feats and s["aux_layer_ids"] == [x + 1 for x in feats]  # input of layer l+1
    assert s["fc_input_size"] == len(feats) * d.config.hidden_size and s["draft_layers"] == 2
    assert s["sample_from_anchor"] is True and s["dspark_bonus_anchor"] is False  # DeepSpec's anchor-first block
    assert s["markov_head_type"] == "vanilla" and s["reduced_vocab"] == d.reduced_vocab
    if d.method == "dflash":
        assert s["markov_rank"] == export.NULL_MARKOV_RANK and s["confidence_head"] is False
    else:
        assert s["markov_rank"] == d.config.deepspec_markov_rank == cfg["drafter"]["markov_rank"]
        assert s["confidence_head"] is True and s["confidence_with_markov"] == d.confidence.with_markov

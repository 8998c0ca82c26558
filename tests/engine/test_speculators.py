"""vLLM's own parsing of our `--format speculators` exports (vLLM 0.32): what `vllm serve DIR`
does first (transformers_utils/config.py maybe_override_with_speculators: the verifier
becomes the model, the speculative config comes from the format), then the speculative
config and the draft model as in tests/engine/test_engine_loaders.py. It must resolve to
method dspark, Qwen3DSparkModel / Qwen3DSparkForCausalLM, our number of speculative
tokens, target layer ids, mask token and DeepSpec's anchor-first block
(sample_from_anchor true, no bonus anchor), and load our tensors bit for bit."""
import json

import pytest

from deepspec.interop import export
from loadcheck_helpers import assert_export_is_the_drafter, assert_loaded_bit_for_bit, drafter, run_loadcheck, vllm_target


@pytest.fixture(scope="module")
def parsed(vllm_python, qwen3_cfg, tmp_path_factory):
    where = tmp_path_factory.mktemp("vllm-speculators")
    target, target_dir = vllm_target(where / "target")
    drafters, cases = {}, []
    for method in ("dspark", "dflash"):
        d = drafter(method, target, qwen3_cfg, mask_token_id=9)
        out = export.export_drafter(d, target, "speculators", where / method, verifier=str(target_dir))
        assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dspark"
        assert_export_is_the_drafter(out, d, target)
        drafters[method] = d
        cases.append({"name": method, "draft": str(out), "speculators": True})
    return drafters, run_loadcheck(vllm_python, cases, where), qwen3_cfg, target_dir


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_vllm_configures_itself_from_our_speculators_export(parsed, method):
    drafters, results, cfg, target_dir = parsed
    d, res = drafters[method], results[method]
    assert res.get("error") is None, res.get("traceback")
    assert res["verifier"] == str(target_dir)  # vllm serve DIR loads the verifier the export names
    assert res["speculative_config"] == {"method": "dspark", "num_speculative_tokens": 7}
    assert_loaded_bit_for_bit(res)
    s = res["settings"]
    assert s["method"] == "dspark" and s["architectures"] == ["Qwen3DSparkModel"]
    assert s["model_class"] == "Qwen3DSparkForCausalLM" and s["num_speculative_tokens"] == d.gamma == 7
    feats = cfg["target"]["feature_layers"]
    assert s["target_layer_ids"] == feats and s["aux_layer_ids"] == [x + 1 for x in feats]
    assert s["mask_token_id"] == s["model_mask_token_id"] == 9
    assert s["sample_from_anchor"] is True and s["dspark_bonus_anchor"] is False
    assert s["markov_rank"] == (export.NULL_MARKOV_RANK if method == "dflash" else cfg["drafter"]["markov_rank"])
    assert s["confidence_head"] is (method == "dspark")

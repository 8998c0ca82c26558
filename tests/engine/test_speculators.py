"""vLLM's own parsing of our `--format speculators` exports (vLLM 0.32): what `vllm serve DIR`
does first (transformers_utils/config.py maybe_override_with_speculators: the verifier
becomes the model, the speculative config comes from the format), then the speculative
config and the draft model as in tests/engine/test_engine_loaders.py. It must resolve to
method dspark, Qwen3DSparkModel / Qwen3DSparkForCausalLM, our number of speculative
tokens, target layer ids, mask token and DeepSpec's anchor-first block
(sample_from_anchor true, no bonus anchor), and load our tensors bit for bit."""
import json

import pytest
import torch

from deepspec.formats import common, export

from loadcheck_helpers import (
    assert_export_is_the_drafter,
    assert_loaded_bit_for_bit,
    drafter,
    run_loadcheck,
    vllm_target,
)


@pytest.fixture(scope="module")
def parsed(vllm_python, qwen3_cfg, tmp_path_factory):
    where = tmp_path_factory.mktemp("vllm-speculators")
    targets = {arch: vllm_target(where / arch, arch) for arch in ("qwen3", "llama")}
    drafters, cases = {}, []
    for name, (arch, method, settings) in CASES.items():
        target, target_dir = targets[arch]
        d = drafter(method, target, qwen3_cfg, **settings)
        if d.reduced_vocab:  # the draft vocabulary: the 300 highest ids, in draft order
            d.set_draft_vocab(torch.arange(target.vocab_size).flip(0).float())
        out = export.export_drafter(d, target, "speculators", where / name, verifier=str(target_dir))
        assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dspark"
        assert_export_is_the_drafter(out, d, target)
        drafters[name] = (d, target, target_dir)
        cases.append({"name": name, "draft": str(out), "speculators": True})
        # a local verifier: the form vLLM >= 0.34 requires (and 0.32 takes), the target served explicitly
        serve = json.loads((out / "config.json").read_text())["deepspec_serve_vllm"]
        assert serve["model"] == str(target_dir)
        cases.append({"name": name + "-explicit", "draft": str(out), "target": serve["model"],
                      "spec": serve["speculative_config"]})
    return drafters, run_loadcheck(vllm_python, cases, where), qwen3_cfg


CASES = {  # name: (target, method, drafter settings)
    "dspark": ("qwen3", "dspark", {"mask_token_id": 9}),
    "dflash": ("qwen3", "dflash", {"mask_token_id": 9}),
    # the CPU presets' DSpark (SmolLM2): Llama target, Qwen3 layers, learned mask (token V), reduced vocabulary
    "llama-target-dspark": ("llama", "dspark", {"layer_arch": "qwen3", "draft_vocab_size": 300}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_configures_itself_from_our_speculators_export(parsed, name):
    drafters, results, cfg = parsed
    (d, target, target_dir), res = drafters[name], results[name]
    method = d.method
    assert res.get("error") is None, res.get("traceback")
    assert res["verifier"] == str(target_dir)  # vllm serve DIR loads the verifier the export names
    assert res["speculative_config"] == {"method": "dspark", "num_speculative_tokens": 7}
    learned = d.config.deepspec_mask_token_id is None
    assert_loaded_bit_for_bit(res, ({"lm_head.weight", "model.markov_head.markov_w2.weight"} if d.reduced_vocab else set())
                              | ({"model.embed_tokens.weight"} if learned else set()))
    s = res["settings"]
    assert s["method"] == "dspark" and s["architectures"] == ["Qwen3DSparkModel"]
    assert s["model_class"] == "Qwen3DSparkForCausalLM" and s["num_speculative_tokens"] == d.gamma == 7
    feats = cfg["target"]["feature_layers"]
    assert s["target_layer_ids"] == feats and s["aux_layer_ids"] == [x + 1 for x in feats]
    assert s["mask_token_id"] == s["model_mask_token_id"] == (target.vocab_size if learned else 9)
    assert s["draft_input_vocab"] == target.vocab_size + learned and s["reduced_vocab"] == d.reduced_vocab
    assert s["sample_from_anchor"] is True and s["dspark_bonus_anchor"] is False
    assert s["markov_rank"] == (common.NULL_MARKOV_RANK if method == "dflash" else cfg["drafter"]["markov_rank"])
    assert s["confidence_head"] is (method == "dspark")


@pytest.mark.parametrize("name", list(CASES))
def test_the_explicit_form_for_a_local_verifier_loads_the_same(parsed, name):
    """`vllm serve TARGET --speculative-config {model: DIR, ...}` (what the export records
    for a local verifier, which vLLM >= 0.34 refuses in `vllm serve DIR`): the same
    settings and the same tensors as vLLM's own reading of the format."""
    drafters, results, _ = parsed
    via_format, explicit = results[name], results[name + "-explicit"]
    assert explicit.get("error") is None, explicit.get("traceback")
    d = drafters[name][0]
    assert explicit["speculative_config"] == {"method": "dspark", "num_speculative_tokens": d.gamma,
                                              "draft_sample_method": "probabilistic"}
    assert explicit["differ"] == [] and explicit["dropped"] == [] and explicit["compared"] == via_format["compared"]
    keep = {k: v for k, v in via_format["settings"].items()}
    assert explicit["settings"] == keep

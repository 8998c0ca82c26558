"""vLLM's own loader on our `--format deepspec --engine vllm` exports (vLLM 0.32):
the speculative config `vllm serve` builds for method "dspark", the model class its
registry picks, `load_weights` on our safetensors, then the CPU loader's
post-processing; every parameter vLLM holds must equal our tensor bit for bit and
the settings it read (mask token, block size, feature layers, Markov and confidence
heads, the anchor-first block) must be ours. Runs deepspec/serving/engine_side/loadcheck.py
with DEEPSPEC_VLLM_PYTHON (tests/engine/conftest.py)."""
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

CASES = {  # name: (target, method, drafter settings)
    "dspark": ("qwen3", "dspark", {"mask_token_id": 3}),
    "dspark-confidence-without-markov": ("qwen3", "dspark", {"mask_token_id": 5, "confidence_with_markov": False}),
    "dspark-reduced-vocab": ("qwen3", "dspark", {"mask_token_id": 3, "draft_vocab_size": 300}),
    "dflash": ("qwen3", "dflash", {"mask_token_id": 7}),  # the null Markov head (common.NULL_MARKOV_RANK)
    # the CPU presets' block drafters (SmolLM2): a Llama target, Qwen3 draft layers, a reduced
    # draft vocabulary and a learned mask embedding (no reserved token), exported as token V
    "llama-target-dspark": ("llama", "dspark", {"layer_arch": "qwen3", "draft_vocab_size": 300}),
    "llama-target-dflash": ("llama", "dflash", {"layer_arch": "qwen3", "draft_vocab_size": 300}),
    # a learned mask embedding over the full vocabulary: the input vocabulary is V + 1, the drafted V
    "llama-target-dspark-full-vocab": ("llama", "dspark", {"layer_arch": "qwen3"}),
}


@pytest.fixture(scope="module")
def loaded(vllm_python, qwen3_cfg, tmp_path_factory):
    where = tmp_path_factory.mktemp("vllm-loaders")
    targets = {arch: vllm_target(where / arch, arch) for arch in ("qwen3", "llama")}
    drafters, cases = {}, []
    for name, (arch, method, settings) in CASES.items():
        target, target_dir = targets[arch]
        d = drafter(method, target, qwen3_cfg, **settings)
        assert d.config.model_type == "qwen3"
        if d.reduced_vocab:  # the draft vocabulary: the 300 highest ids, in draft order
            d.set_draft_vocab(torch.arange(target.vocab_size).flip(0).float())
        out = export.export_drafter(d, target, "deepspec", where / name, engine="vllm")
        assert_export_is_the_drafter(out, d, target)
        drafters[name] = (d, target)
        cases.append({"name": name, "draft": str(out), "target": str(target_dir)})
    return drafters, run_loadcheck(vllm_python, cases, where), qwen3_cfg


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_loads_our_export_bit_for_bit(loaded, name):
    drafters, results, cfg = loaded
    (d, target), res = drafters[name], results[name]
    learned = d.config.deepspec_mask_token_id is None  # the mask is token V of the drafter's own embedding
    padded = {"lm_head.weight", "model.markov_head.markov_w2.weight"} if d.reduced_vocab else set()
    assert_loaded_bit_for_bit(res, padded | ({"model.embed_tokens.weight"} if learned else set()))
    s = res["settings"]
    assert s["method"] == "dspark" and s["architectures"] == ["Qwen3DSparkModel"]
    assert s["model_class"] == "Qwen3DSparkForCausalLM" and s["dtype"] == "torch.float32"
    assert s["num_speculative_tokens"] == s["block_size"] == d.gamma == 7
    assert s["target_vocab"] == target.vocab_size  # an input vocabulary one larger: vLLM keeps the drafter's own
    assert s["draft_input_vocab"] == target.vocab_size + learned
    assert s["mask_token_id"] == s["model_mask_token_id"] == (target.vocab_size if learned else d.config.deepspec_mask_token_id)
    feats = cfg["target"]["feature_layers"]
    assert s["target_layer_ids"] == feats and s["aux_layer_ids"] == [x + 1 for x in feats]  # input of layer l+1
    assert s["fc_input_size"] == len(feats) * d.config.hidden_size and s["draft_layers"] == 2
    assert s["sample_from_anchor"] is True and s["dspark_bonus_anchor"] is False  # DeepSpec's anchor-first block
    assert s["markov_head_type"] == "vanilla" and s["reduced_vocab"] == d.reduced_vocab
    if d.method == "dflash":
        assert s["markov_rank"] == common.NULL_MARKOV_RANK and s["confidence_head"] is False
    else:
        assert s["markov_rank"] == d.config.deepspec_markov_rank == cfg["drafter"]["markov_rank"]
        assert s["confidence_head"] is True and s["confidence_with_markov"] == d.confidence.with_markov


def test_vllm_loads_the_cpu_presets_block_drafters(vllm_python, resources_dir, tmp_path):
    """The CPU default's DSpark and DFlash as the preset builds them (SmolLM2-135M, a Llama
    target without a reserved token; Qwen3 draft layers; the 8k draft vocabulary; a learned
    mask embedding), exported for vLLM and loaded by vLLM's loader over the real SmolLM2:
    every tensor bit for bit, the mask as token V of the drafter's own input vocabulary."""
    from deepspec import paths
    from deepspec.config import load_config
    from deepspec.drafters import build_drafter
    from deepspec.targets.loading import target_from_config

    cfg = load_config("smollm2-135m", {"resources_dir": str(resources_dir)})
    target = target_from_config(cfg)
    V, cases, drafters = target.vocab_size, [], {}
    for method in ("dspark", "dflash"):
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg).eval()
        d.set_draft_vocab(torch.rand(V))
        assert d.config.model_type == "qwen3" and d.config.deepspec_mask_token_id is None and d.reduced_vocab
        out = export.export_drafter(d, target, "deepspec", tmp_path / method, engine="vllm")
        assert_export_is_the_drafter(out, d, target)
        drafters[method] = d
        cases.append({"name": method, "draft": str(out), "target": str(paths.RunPaths.of(cfg).target_checkpoint())})
    results = run_loadcheck(vllm_python, cases, tmp_path)
    for method, d in drafters.items():
        res = results[method]
        assert_loaded_bit_for_bit(res, {"model.embed_tokens.weight"})  # V + 1 rows, padded to vLLM's multiple
        s = res["settings"]
        assert s["model_class"] == "Qwen3DSparkForCausalLM" and s["draft_layers"] == d.config.num_hidden_layers
        assert s["mask_token_id"] == s["model_mask_token_id"] == V and s["draft_input_vocab"] == V + 1
        assert s["target_vocab"] == V and s["reduced_vocab"] is True
        assert s["target_layer_ids"] == list(cfg["target"]["feature_layers"])
        assert s["markov_rank"] == (common.NULL_MARKOV_RANK if method == "dflash" else cfg["drafter"]["markov_rank"])

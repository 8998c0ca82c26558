"""SGLang's own model classes and loaders on our SGLang exports: SGLang 0.5.23's
Qwen3DSparkModel (DSPARK) and LlamaForCausalLMEagle3 (EAGLE3), built on CPU in
the SGLang python (DEEPSPEC_SGLANG_PYTHON) by
deepspec/serving/engine_side/sglang_loadcheck.py with every parameter NaN, then
fed the export through their `load_weights`. Every parameter SGLang holds must be
reached by a tensor of the export (its loaders skip names they do not know without
a word) and equal the drafter's, q/k/v and gate/up stacked as SGLang stacks them;
SGLang must read the drafter's settings (block, Markov head, mask token, feature
layers, confidence head) from the config. The EAGLE-3 drafters have the tiny preset's
2 feature layers: SGLang sizes `fc` from the config's layer list, not for 3."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepspec.formats import export

from helpers import random_drafter

REPO = Path(__file__).resolve().parents[2]
LOADCHECK = REPO / "deepspec" / "serving" / "engine_side" / "sglang_loadcheck.py"
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LEGACY = {"layers.0.": "midlayer."}  # EAGLE-3 names SGLang renames on load


def _alg1(where: Path, gamma: int = 7) -> Path:
    """A schedule rule's alg1.json (STS temperatures and SPS(B)) and calibration CSV."""
    a = where / "gsm8k.alg1.json"
    a.write_text(json.dumps({"target": "tiny-qwen3", "method": "dspark", "benchmark": "gsm8k", "gamma": gamma,
                             "sts_temperatures": [0.5 + 0.25 * k for k in range(gamma)],
                             "n_rounds_fit": 40, "n_rounds_eval": 38,
                             "sps": {"batch_tokens": [1, 2, 4, 8, 16, 32], "steps_per_s": [50, 49, 47, 44, 38, 30]}}))
    rows = "\n".join(f"{k},{0.1 + k / 100},{0.05 + k / 200},0.7,10,1.0,0.7" for k in range(1, gamma + 1))
    (where / "gsm8k.calibration.csv").write_text("position,ece_before,ece_after,auroc,n,temperature,auroc_after\n" + rows + "\n")
    return a


def _run(python: str, cases: list, where: Path) -> dict:
    req, res = where / "request.json", where / "result.json"
    req.write_text(json.dumps({"cases": cases}))
    r = subprocess.run([python, str(LOADCHECK), str(req), str(res)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and res.exists(), f"sglang_loadcheck.py exited {r.returncode}:\n{r.stderr[-4000:]}"
    return json.loads(res.read_text())


def _expected(name: str, sd: dict) -> torch.Tensor:
    """The export's tensor for SGLang parameter `name` (its "model." prefix, stacked projections, legacy names)."""
    bare = name.removeprefix("model.")
    candidates = [bare, name] + [bare.replace(new, old) for new, old in LEGACY.items() if new in bare]
    for fused, parts in STACKED.items():
        if f".{fused}." in bare:
            for c in candidates:
                names = [c.replace(fused, p) for p in parts]
                if all(n in sd for n in names):
                    return torch.cat([sd[n] for n in names], 0)
    for c in candidates:
        if c in sd:
            return sd[c]
    raise AssertionError(f"SGLang parameter {name} has no tensor in the export")


@pytest.fixture(scope="module")
def checked(sglang_python, qwen3_target, qwen3_cfg, tiny_target, tiny_cfg, tmp_path_factory):
    where = tmp_path_factory.mktemp("sglang")
    alg1 = _alg1(where)
    kinds = {"dspark-vanilla-scheduled": ("vanilla", True, {"sts": alg1, "sps": alg1}),
             "dspark-rnn-scheduled": ("rnn", True, {"sts": alg1, "sps": alg1}),
             "dspark-no-confidence": ("vanilla", False, {}),
             "dspark-confidence-unscheduled": ("vanilla", True, {})}
    drafters, cases = {}, []
    for name, (kind, confidence, files) in kinds.items():
        d, c = random_drafter("dspark", qwen3_target, qwen3_cfg, mask_token_id=3, markov_head_type=kind,
                              confidence_head=confidence)
        out = export.export_drafter(d, qwen3_target, "deepspec", where / name, engine="sglang", **files)
        drafters[name] = (d, c["drafter"])
        cases.append({"name": name, "draft": str(out)})
    for name, vocab in (("eagle3", None), ("eagle3-reduced", 100)):  # the CPU preset's Eagle3: an 8k draft vocabulary
        e3, _ = random_drafter("eagle3", tiny_target, tiny_cfg, draft_vocab_size=vocab)
        out = export.export_drafter(e3, tiny_target, "eagle3", where / name, engine="sglang")
        drafters[name] = (e3, None)
        cases.append({"name": name, "draft": str(out)})
    return drafters, _run(sglang_python, cases, where), {c["name"]: Path(c["draft"]) for c in cases}


@pytest.mark.parametrize("name", ["dspark-vanilla-scheduled", "dspark-rnn-scheduled", "dspark-no-confidence",
                                  "dspark-confidence-unscheduled", "eagle3", "eagle3-reduced"])
def test_sglang_loads_every_parameter_of_our_export(checked, name):
    drafters, results, dirs = checked
    assert results["sglang"] == "0.5.23"
    r = results[name]
    assert "error" not in r, r.get("traceback")
    assert r["not_loaded"] == [], f"SGLang parameters no tensor of the export reached: {r['not_loaded']}"
    # the target's embedding (and head) that SGLang's worker attaches: never read from the export
    assert r["attached_from_target"] == (["model.embed_tokens.weight"] if name.startswith("eagle3") else [])
    sd = load_file(str(dirs[name] / "model.safetensors"))
    loaded = load_file(r["loaded_file"])
    assert set(loaded) == set(r["params"]) - set(r["attached_from_target"]) and loaded
    for p, t in loaded.items():
        want = _expected(p, sd).to(t.dtype)
        if t.shape[0] > want.shape[0] and t.shape[1:] == want.shape[1:]:  # ParallelLMHead's padded vocabulary
            assert not t[want.shape[0]:].any(), p
            t = t[: want.shape[0]]
        assert torch.equal(t, want), p


@pytest.mark.parametrize("name", ["dspark-vanilla-scheduled", "dspark-rnn-scheduled", "dspark-no-confidence",
                                  "dspark-confidence-unscheduled"])
def test_sglang_reads_the_dspark_settings(checked, qwen3_cfg, name):
    drafters, results, _ = checked
    (_, settings), s = drafters[name], results[name]["settings"]
    assert s["model_class"] == "Qwen3DSparkModel"
    assert (s["gamma"], s["block_size"], s["draft_layers"]) == (7, 7, 2)
    assert (s["markov_rank"], s["markov_head_type"]) == (settings["markov_rank"], settings["markov_head_type"])
    assert s["markov_class"] == {"vanilla": "VanillaMarkov", "rnn": "RNNHead"}[s["markov_head_type"]]
    assert s["mask_token_id"] == 3 and s["sample_from_anchor"] is True
    assert s["target_layer_ids"] == qwen3_cfg["target"]["feature_layers"]
    # the confidence head is built and loaded in the ragged verify mode the export's config sets
    # (compact, with the STS/SPS files); SGLang's default mode, static, builds none
    assert s["confidence_head"] is name.endswith("-scheduled")
    env = results[name]["env"]
    assert env == ({"SGLANG_RAGGED_VERIFY_MODE": "compact"} if name.endswith("-scheduled") else
                   {"SGLANG_RAGGED_VERIFY_MODE": "static"} if name == "dspark-no-confidence" else {})
    if s["confidence_head"]:
        assert s["confidence_with_markov"] is True


@pytest.mark.parametrize("name", ["eagle3", "eagle3-reduced"])
def test_sglang_reads_the_eagle3_settings(checked, tiny_cfg, name):
    drafters, results, dirs = checked
    s, (e3, _) = results[name]["settings"], drafters[name]
    assert s["model_class"] == "LlamaForCausalLMEagle3" and s["draft_layers"] == 1
    assert s["aux_layer_ids"] == tiny_cfg["target"]["feature_layers"]
    assert s["draft_vocab_size"] == e3.draft_vocab_size
    # SGLang maps draft ids to target ids through d2t (hot_token_id) whenever the export has one
    assert s["hot_token_id"] is ("d2t" in load_file(str(dirs[name] / "model.safetensors")))
    assert s["load_lm_head_from_target"] is False  # the export carries the head SGLang serves

"""Dress rehearsal of the paper presets on CPU (config/presets/rehearsal-*.yaml):
a paper preset in every setting but the target (a tiny random one) and the sizes
two CPU cores force, run end to end through the DAG, then `plan` on the same preset.
rehearsal-qwen3 rehearses qwen3-4b (tiny-qwen3), rehearsal-gemma4 gemma4-12b
(tiny-gemma4-unified: the gemma4_unified classes).

The allow-list below is every key that may differ from the paper preset: a new
paper setting the rehearsal does not follow, or a difference that is no longer
needed, fails the test."""
import sys
from pathlib import Path

import pytest

from deepspec.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import REHEARSALS  # noqa: E402

# the keys a rehearsal may change in its paper preset, as dotted paths
ALLOWED = {
    # the target: a tiny random one with the SmolLM2 tokenizer, float32 on CPU
    # (a builtin target has no hub revision: naming another spec drops the paper preset's commit)
    "preset", "description", "target.name", "target.spec", "target.revision", "target.feature_layers", "target.dtype",
    "target.device", "drafter.mask_token_id", "eval.dtype",
    # local prompt files in place of Open-PerfectBlend (hub), a few prompts each; plan counts them
    "data.train", *(f"data.benchmarks.{b}.cap" for b in ("gsm8k", "math500", "aime25", "mbpp", "humaneval",
                                                         "livecodebench", "mt-bench", "alpaca", "arena-hard")),
    "plan.train_prompts", "plan.prompt_tokens", "plan.answer_tokens",
    # sizes: sequence and answer lengths, steps, batches
    "data.max_length", "regenerate.max_new_tokens", "train.epochs", "train.global_batch",
    "train.num_anchors", "eval.max_new_tokens", "eval.speed_benchmarks",
    # the regeneration server: deepspec serve on CPU in place of vLLM on 8 GPUs
    *(f"regenerate.server.{k}" for k in ("command", "gpus", "threads", "mem_mb")),
    # CPU: two training processes, no GPUs, small scheduler resources
    "train.gpus", "train.processes", "eval.gpus", *(f"resources.{r}.{k}" for r, ks in {
        "regenerate": ("threads", "mem_mb", "runtime"), "tokenize": ("threads", "mem_mb", "runtime"),
        "build_cache": ("gpu", "mem_mb", "runtime"),
        "train": ("gpu", "mem_mb", "runtime", "threads"), "evaluate": ("gpu", "mem_mb", "runtime", "threads"),
    }.items() for k in ks),
}
# rehearsal preset -> its paper preset (the tiny Gemma4 target: the gemma4_unified classes)


def _leaves(node, prefix=""):
    """{dotted key: value} of a config's leaves (lists are leaves)."""
    if isinstance(node, dict) and node:
        out = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


@pytest.mark.parametrize("rehearsal", sorted(REHEARSALS))
def test_rehearsal_differs_from_its_paper_preset_only_where_allowed(rehearsal):
    paper, allowed = REHEARSALS[rehearsal], ALLOWED
    a, b = _leaves(load_config(rehearsal)), _leaves(load_config(paper))
    differ = {k for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>")}
    assert differ - allowed == set(), "settings that differ from the paper preset without being allowed"
    assert allowed - differ == set(), "allowed differences that no longer differ: remove them from the list"
    cfg = load_config(rehearsal)
    assert cfg["cache"]["mode"] == "online" and cfg["train"]["processes"] == 2 and cfg["train"]["gpus"] == 0



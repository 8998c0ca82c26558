"""Checks that need only the config and the file system, run when the DAG is
planned (workflow/rules/common.smk), so that a preset that cannot work stops
with one line before any job runs, not after regeneration, caching or
training. (Missing prompt files are `prepare_data.check_sources`'s: it knows
which ones the prepare_data rule can build.)
"""
from __future__ import annotations

import json

from ..architectures import check_model_type
from ..config import REPO_ROOT
from ..errors import DeepSpecError
from ..paths import RunPaths
from ..methods import fig3_methods, fig4_methods, resolve_method

# Decoder depth of the builtin targets (targets/loading.py), known before they are prepared.
BUILTIN_LAYERS = {"smollm2-135m": 30}


def _offline_text_config(cfg: dict):
    """(the target's text config fields, where from) when known without loading it: the
    prepared checkpoint's config, the shipped architecture facts, the builtin tiny specs; else None."""
    t = cfg["target"]
    for path in (RunPaths.of(cfg).target_checkpoint() / "config.json", REPO_ROOT / "config" / "targets" / f"{t['name']}.json"):
        if path.exists():
            c = json.loads(path.read_text())
            return (c.get("text_config") or c), str(path)
    from ..targets.tiny import TINY_SPECS, tiny_config

    if t["spec"] in TINY_SPECS:  # the builtin random targets
        c = tiny_config(TINY_SPECS[t["spec"]])
        return {"model_type": c.model_type, "num_hidden_layers": c.num_hidden_layers}, t["spec"]
    return None, None


def target_num_layers(cfg: dict):
    """The target's decoder depth when it can be known offline: the prepared
    checkpoint's config, the architecture facts, the builtin specs, or a local hub cache; else None."""
    spec = cfg["target"]["spec"]
    c, _ = _offline_text_config(cfg)
    if c is not None:
        return c.get("num_hidden_layers")
    if spec in BUILTIN_LAYERS:
        return BUILTIN_LAYERS[spec]
    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(spec, revision=cfg["target"].get("revision"), local_files_only=True)
        return c.get_text_config().num_hidden_layers
    except Exception:  # not cached here: checked when the target is loaded
        return None


def preflight(cfg: dict) -> None:
    """Raise a one-line DeepSpecError for the first problem found."""
    methods = list(cfg["train"]["methods"]) + fig3_methods(cfg) + fig4_methods(cfg)
    for name in methods:
        resolve_method(cfg, name)  # an unknown method is a one-line error
    t = cfg["train"]
    world = max(1, int(t["gpus"]))
    if int(t["global_batch"]) % (world * int(t["micro_batch"])):
        raise DeepSpecError(f"train.global_batch ({t['global_batch']}) must be a multiple of train.micro_batch "
                            f"({t['micro_batch']}) x processes ({world})")
    for name in cfg["eval"].get("speed_benchmarks") or []:
        if name not in cfg["data"]["benchmarks"]:
            raise DeepSpecError(f"eval.speed_benchmarks: '{name}' is not a benchmark of this preset "
                                f"({', '.join(cfg['data']['benchmarks'])})")
    text, where = _offline_text_config(cfg)
    if text is not None and text.get("model_type") is not None:
        check_model_type(text["model_type"], f"target {cfg['target']['spec']!r} ({where})")
    n = target_num_layers(cfg)
    for layer in cfg["target"]["feature_layers"]:
        if n is not None and not -1 <= int(layer) <= n - 2:
            raise DeepSpecError(f"target.feature_layers: layer {layer} is out of range for the {n}-layer target "
                                f"{cfg['target']['spec']!r}: use -1 (embeddings) .. {n - 2}; the final layer {n - 1} "
                                "is not allowed (HF stores its post-norm value)")

"""Checks that need only the config and the file system, run when the DAG is
planned (workflow/rules/common.smk), so that a preset that cannot work stops
with one line before any job runs, not after regeneration, caching or
training. (Missing prompt files are `prepare_data.check_sources`'s: it knows
which ones the prepare_data rule can build.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Mapping

from ..architectures import check_model_type, draft_model_type, layer_arch_of
from ..config import add_config_args, config_from_args
from ..errors import DeepSpecError
from ..methods import fig3_methods, fig4_methods, method_settings, resolve_method
from ..settings import Settings
from ..targets.specs import known_config, text_dims, text_fields
from ..training.recipe import accumulation_steps


def target_num_layers(cfg: Settings | Mapping):
    """The target's decoder depth when it can be known offline (targets.specs.text_dims); else None."""
    dims = text_dims(cfg)
    return None if dims is None else dims.get("num_hidden_layers")


def preflight(cfg) -> None:
    """Raise a one-line DeepSpecError for the first problem found. `cfg`: the
    validated config (the Snakefile's) or its Settings."""
    s = Settings.view(cfg)
    methods = list(s.train.methods) + fig3_methods(s) + fig4_methods(s)
    for name in methods:
        resolve_method(s, name)  # an unknown method is a one-line error
    accumulation_steps(s.train, max(1, s.train.gpus))
    for name in s.eval.speed_benchmarks or []:
        if name not in s.data.benchmarks:
            raise DeepSpecError(f"eval.speed_benchmarks: '{name}' is not a benchmark of this preset "
                                f"({', '.join(s.data.benchmarks)})")
    fields, where = known_config(s)
    if fields is not None and text_fields(fields).get("model_type") is not None:
        model_type = text_fields(fields)["model_type"]
        check_model_type(model_type, f"target {s.target.spec!r} ({where})")
        for name in methods:  # drafter.layer_arch: layers this target can have
            base, ms = method_settings(s, name)
            draft_model_type(model_type, layer_arch_of(ms.drafter, base), f"{name} drafter")
    n = target_num_layers(s)
    for layer in s.target.feature_layers:
        if n is not None and not -1 <= int(layer) <= n - 2:
            raise DeepSpecError(f"target.feature_layers: layer {layer} is out of range for the {n}-layer target "
                                f"{s.target.spec!r}: use -1 (embeddings) .. {n - 2}; the final layer {n - 1} "
                                "is not allowed (HF stores its post-norm value)")
    for method, released in s.eval.released_checkpoints.items():
        if isinstance(released, str) and not Path(released).is_dir():
            raise DeepSpecError(f"eval.released_checkpoints.{method}: no directory {released!r} here ({os.getcwd()}): "
                                "a local checkpoint in DeepSeek's released layout, or {hub: <id>, revision: <commit>}")


def cli_show_config(argv) -> int:
    """The preset as the run sees it: validated, defaults filled in, and checked as
    the DAG checks it when planned (`preflight`)."""
    p = argparse.ArgumentParser(prog="deepspec show-config")
    add_config_args(p)
    cfg = config_from_args(p.parse_args(argv))
    preflight(cfg)
    if os.environ.get("DEEPSPEC_DATA"):
        print(f"note: prompt files are read from $DEEPSPEC_DATA={os.environ['DEEPSPEC_DATA']}, not data.root",
              file=sys.stderr)
    print(json.dumps(cfg, indent=2))
    return 0

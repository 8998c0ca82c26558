"""CLI for targets and presets: prepare-target, show-config."""
from __future__ import annotations

import argparse
import json
import logging
import time

from .cli import add_config_args, config_from_args

log = logging.getLogger("deepspec.prepare_target")


def cli_prepare_target(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec prepare-target", description=__doc__)
    p.add_argument("spec", help="smollm2-135m | tiny | hub id | local path")
    p.add_argument("--out", required=True, help="output directory (a plain HF checkpoint)")
    args = p.parse_args(argv)
    from .targets import prepare_target

    t0 = time.perf_counter()
    out = prepare_target(args.spec, args.out)
    log.info("prepared %s in %s (%.1f s)", args.spec, out, time.perf_counter() - t0)
    # Reload once as a check: a plain from_pretrained must work offline.
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out))
    log.info("reloaded: %d layers, hidden %d, vocab %d", m.config.num_hidden_layers, m.config.hidden_size, m.config.vocab_size)
    return 0


def cli_show_config(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec show-config")
    add_config_args(p)
    args = p.parse_args(argv)
    print(json.dumps(config_from_args(args), indent=2))
    return 0

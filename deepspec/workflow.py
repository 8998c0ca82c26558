"""The rules' one interface to the package (workflow/rules/*.smk import only
this module): what Snakemake reads when it parses the DAG. It is imported at
parse time, so it and everything it imports stay light (no torch): the config
and its settings fingerprints, the path layout, the plan-time checks, the GPU
and launcher prefixes of the rules' commands, and the regeneration server's
command line (`server_command`)."""
from __future__ import annotations

import logging
import shlex
from typing import Mapping, Optional

from .checkout import enter as enter_checkout
from .config import coerce_overrides, load_config, settings_fingerprint
from .data.prompts import data_root, is_prompt_file, speed_benchmarks
from .data.sources import check_sources, needed_files
from .errors import DeepSpecError
from .fetch import hub_datasets, released_hub, snapshot_name
from .gpus import gpu_env
from .methods import fig3_methods, fig4_methods
from .paths import RunPaths
from .planning.preflight import preflight
from .provenance import SOURCE_FILE
from .regeneration.supervisor import fill_command
from .settings import Settings
from .training.launch import launcher as train_launcher
from .vllm_env import vllm_command

__all__ = ["DeepSpecError", "RunPaths", "SOURCE_FILE", "check_sources", "coerce_overrides", "data_root",
           "enter_checkout", "fig3_methods", "fig4_methods", "gpu_env", "hub_datasets", "is_prompt_file", "load_config",
           "needed_files",
           "preflight", "released_hub", "server_command", "settings_fingerprint", "Settings", "snapshot_name",
           "speed_benchmarks",
           "train_launcher"]

log = logging.getLogger(__name__)


def server_command(cfg: Settings | Mapping) -> tuple[str, Optional[str]]:
    """(command line, engine) of the regeneration server (regenerate.server) that
    `python -m deepspec run-server` starts: regenerate.server.command with {model},
    {host} and {name} filled in, {port} too when the port is fixed (else run-server
    fills it in, and the other braces stay escaped for it); a command that runs
    `vllm` takes vLLM from its own environment where it has one (serve.vllm_python,
    deepspec/vllm_env.py), and its engine is "vllm" (run-server checks its
    /version), else None. A bad placeholder is a one-line DeepSpecError."""
    s = Settings.view(cfg)
    srv = s.regenerate.server
    paths = RunPaths.of(s)
    try:
        command = fill_command(
            srv["command"],
            model=shlex.quote(str(paths.target_checkpoint())),
            port=srv["port"],  # None: chosen by run-server, which fills in {port}
            host=srv["host"] or "127.0.0.1",
            name=shlex.quote(s.regenerate.model_name or s.target.spec),
        )
    except (KeyError, IndexError, ValueError) as e:
        raise DeepSpecError(f"regenerate.server.command: cannot fill in {e} (placeholders: {{model}}, {{port}}, "
                            "{host}, {name}; write literal braces as {{ and }})") from None
    if command.split()[:1] != ["vllm"]:
        return command, None
    try:
        vllm = vllm_command(s.serve.vllm_python)
    except DeepSpecError as e:  # planned anyway (a dry run of a GPU preset on a laptop); run-server fails at once
        log.warning("the regeneration server runs vLLM: %s", e)
        return command, "vllm"
    return (vllm if srv["port"] else vllm.replace("{", "{{").replace("}", "}}")) + command[len("vllm"):], "vllm"

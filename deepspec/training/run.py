"""`python -m deepspec train`: one drafter trained from a preset. It builds the
target, the dataset of `deepspec.data.datasets` and a drafter of
`deepspec.drafters`, whose `training_step` (`deepspec.core.train_step`) is the
step function of the generic loop (`deepspec.training.loop.train`), after
checking that one step fits this machine's memory."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import subprocess
from pathlib import Path
from typing import Mapping, Optional

import torch

from ..config import rule_settings
from ..core.losses import LossWeights
from ..core.train_step import StepSpec
from ..data.cache import bytes_per_token, stores_log_normalizers
from ..errors import DeepSpecError
from ..files import human_bytes
from ..paths import RunPaths
from ..settings import Settings, Train
from .checkpoints import training_fingerprint
from .launch import direct_command, free_port
from .loop import TrainResult, process_device, train
from .recipe import data_order_bytes, training_memory

log = logging.getLogger(__name__)


def step_spec(cfg: Settings | Mapping) -> StepSpec:
    """The training step's settings from a preset (train.num_anchors, the loss section)."""
    s = Settings.view(cfg)
    t = s.train
    return StepSpec(num_anchors=t.num_anchors, chain_rows=t.chain_rows, coef=LossWeights(**dataclasses.asdict(s.loss)),
                    chunk_positions=t.chunk_positions)



def machine_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what) of the memory a training process on `device` may use: the
    GPU's, else the machine's physical memory or its cgroup limit, the smaller."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"GPU {device}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total, "this machine"



# the largest part of a step's memory: what it is, and what makes it smaller
_MEMORY_PARTS = {
    "data_order": ("the data order of a global batch", "lower train.global_batch"),
    "activations": ("a micro batch's cached features at data.max_length", "lower train.micro_batch or data.max_length"),
    "adam_moments": ("AdamW's moments", "a smaller drafter (drafter.num_layers, drafter.draft_vocab_size)"),
    "gradients": ("the gradients", "a smaller drafter (drafter.num_layers, drafter.draft_vocab_size)"),
    "drafter_weights": ("the drafter's weights", "a smaller drafter (drafter.num_layers, drafter.draft_vocab_size)"),
    "target_weights": ("the target's weights", "target.dtype bfloat16, or a machine with more memory"),
}



def check_step_memory(cfg: Settings | Mapping, drafter, target, num_samples: int, device: torch.device) -> dict:
    """Refuse, in one line, a run whose training step cannot fit in memory, before
    anything is trained (a too large batch would otherwise grow until the kernel's
    OOM killer ends it, and other jobs with it). The plan's arithmetic
    (`recipe.training_memory`), with a micro batch's cached features at
    data.max_length standing in for the activations the plan measures on meta (so
    a lower bound), plus the data order (`recipe.data_order_bytes`); on CPU the
    train.processes processes share the machine. Returns the parts (bytes)."""
    s = Settings.view(cfg)
    t = s.train
    shared = {id(p) for m in (target.embed_tokens, target.lm_head) for p in m.parameters()}
    own = [p for p in drafter.parameters() if id(p) not in shared]
    params = {"trainable": sum(p.numel() for p in own if p.requires_grad),
              "frozen_own": sum(p.numel() for p in own if not p.requires_grad)}
    features = t.micro_batch * s.data.max_length * bytes_per_token(
        len(s.target.feature_layers), target.hidden_size, s.cache.dtype, stores_log_normalizers(s))
    mem = training_memory(s, sum(p.numel() for p in target.model.parameters()), params, features)
    parts = {k: mem[k] for k in _MEMORY_PARTS if k in mem}
    parts["data_order"] = data_order_bytes(num_samples, t.global_batch)
    procs = t.processes if device.type == "cpu" else 1
    need = procs * sum(parts.values())
    have, where = machine_memory(device)
    if need > have:
        big = max(parts, key=parts.get)
        what, fix = _MEMORY_PARTS[big]
        raise DeepSpecError(f"a training step needs at least {human_bytes(need)}{f' ({procs} processes)' if procs > 1 else ''}"
                            f" but {where} has {human_bytes(have)}: {human_bytes(procs * parts[big])} of it {what}; {fix}")
    return parts



def run_from_config(cfg: dict, method: str, out_dir=None, resume: Optional[bool] = None) -> TrainResult:
    """Load the target, build the dataset and drafter, train (the CLI's body).

    `method` is eagle3, dflash, dspark or an ablation variant name
    (deepspec.methods, e.g. dspark-l2); the default output directory is
    <results>/<target>/drafters/<method>.
    """
    from .. import drafters
    from ..data.datasets import make_train_dataset, token_counts, train_collate
    from ..methods import resolve_method
    from ..targets.loading import target_from_config

    base, cfg = resolve_method(cfg, method)  # the variant's config
    s = Settings.of(cfg)
    device = s.target.device
    target = target_from_config(cfg, device=str(process_device(device)))
    dataset = make_train_dataset(cfg, target=target)
    counts = token_counts(dataset, target.vocab_size) if s.drafter.draft_vocab_size else None
    torch.manual_seed(s.train.seed)  # deterministic drafter initialisation
    drafter = drafters.build_drafter(base, target, s, token_counts=counts)
    check_step_memory(s, drafter, target, len(dataset), process_device(device))
    spec = step_spec(s)

    def step_fn(model, batch, generator, log_step=True):
        return model.training_step(batch, spec, generator, log_step=log_step)

    out = Path(out_dir) if out_dir else RunPaths.of(cfg).drafter_dir(method)
    # every setting that changes the result (the variant's, after resolve_method) and the data
    fingerprint = training_fingerprint(method, rule_settings(cfg, "train"), dataset.fingerprint)
    log.info("training %s (%s) on %s -> %s (fingerprint %s)", method, base, s.target.name, out, fingerprint)
    collate_fn = train_collate(dataset)  # online: one target forward per micro batch, counted
    return train(drafter, dataset, step_fn, s.train, out, collate_fn=collate_fn, resume=resume, device=device,
                 fingerprint=fingerprint, counters=getattr(collate_fn, "counters", None))



def cli_train(argv=None) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec train", description="train a drafter (eagle3, dflash, dspark)")
    add_config_args(p)
    p.add_argument("--method", required=True,
                   help="eagle3 | dflash | dspark, or an ablation variant such as dspark-l2 (deepspec.methods)")
    p.add_argument("--out", default=None, help="output directory (default: <results>/<target>/drafters/<method>)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="resume from <out>/checkpoints/latest (default: when it exists); --no-resume starts afresh")
    p.add_argument("--max-steps", type=int, default=None, help="cap the number of optimiser steps")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise DeepSpecError("--max-steps must be at least 1")
        cfg["train"]["max_steps"] = args.max_steps
    cmd = direct_command(Train.of(cfg["train"]), os.environ, argv, free_port())
    if cmd is not None:  # train.processes > 1 (CPU) or train.gpus > 1: start them, as the train rule does
        log.info("starting the training processes: %s", shlex.join(cmd))
        rc = subprocess.run(cmd).returncode
        if rc:
            raise DeepSpecError(f"the training processes failed (exit {rc}; their messages are above): {shlex.join(cmd)}")
        return 0
    run_from_config(cfg, args.method, args.out, args.resume)
    return 0

"""What the training loop (`deepspec.training.loop`) and its checkpoints
(`deepspec.training.checkpoints`) share: the train settings they read, typed
once (`TrainSettings`), and the run fixed before the first step (`TrainRun`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from .recipe import StepSampler

StepFn = Callable[[torch.nn.Module, dict, torch.Generator], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class TrainSettings:
    """The `train` section's settings of a run's steps and checkpoints. The
    schema fixes the types; the keys read with `.get` may be absent from a
    train section that did not come from a preset (the tests' toy runs)."""

    global_batch: int
    micro_batch: int
    seed: int
    grad_clip: float
    log_every: int
    checkpoint_every: int
    checkpoint_minutes: Optional[float] = None  # also checkpoint after this many minutes; None: steps only
    keep_checkpoints: Optional[int] = None  # keep the newest N regular checkpoints; None keeps all
    shard_optimizer: bool = False

    @classmethod
    def of(cls, train_cfg: Mapping) -> "TrainSettings":
        return cls(
            global_batch=int(train_cfg["global_batch"]), micro_batch=int(train_cfg["micro_batch"]),
            seed=int(train_cfg["seed"]), grad_clip=float(train_cfg["grad_clip"]), log_every=int(train_cfg["log_every"]),
            checkpoint_every=int(train_cfg["checkpoint_every"]), checkpoint_minutes=train_cfg.get("checkpoint_minutes"),
            keep_checkpoints=train_cfg.get("keep_checkpoints"), shard_optimizer=bool(train_cfg.get("shard_optimizer")),
        )


@dataclass
class TrainRun:
    """What every step of a run needs, fixed before the first one."""

    acc: object  # the Accelerator
    model: torch.nn.Module
    params: list
    opt: object
    sched: object
    gen: torch.Generator  # the anchor generator handed to step_fn
    dataset: object
    collate_fn: Callable[[list], dict]
    step_fn: StepFn
    settings: TrainSettings
    out: Path
    sampler: StepSampler
    per_epoch: int
    total: int
    fingerprint: str

    @property
    def world(self) -> int:
        return self.acc.num_processes

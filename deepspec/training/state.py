"""What the training loop (`deepspec.training.loop`) and its checkpoints
(`deepspec.training.checkpoints`) share: the run fixed before the first step
(`TrainRun`), with its typed train settings (`settings.Train`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..settings import Train
from .recipe import StepSampler

StepFn = Callable[[torch.nn.Module, dict, torch.Generator], tuple[torch.Tensor, dict]]


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
    settings: Train
    out: Path
    sampler: StepSampler
    per_epoch: int
    total: int
    fingerprint: str

    @property
    def world(self) -> int:
        return self.acc.num_processes

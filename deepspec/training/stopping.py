"""Stopping a training run cleanly: SIGTERM (a walltime limit's warning) lets
the current step finish, then every process agrees to checkpoint and stop."""
from __future__ import annotations

import logging
import signal
import threading

import torch

from ..errors import DeepSpecError

log = logging.getLogger(__name__)

class TrainingStopped(DeepSpecError):
    """SIGTERM arrived: a checkpoint of the last finished step was written."""


def launcher_honours_shutdown_timeout() -> bool:
    """Whether this torch's elastic launcher waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the
    train rule sets 600 s) between SIGTERM and SIGKILL; before torch's
    `LaunchConfig.shutdown_timeout` it kills the workers after a fixed 30 s."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return any(f.name == "shutdown_timeout" for f in dataclasses.fields(LaunchConfig))


def warn_if_sigterm_checkpoint_may_be_cut(world: int) -> bool:
    """With several processes on a torch whose launcher ignores the shutdown timeout,
    say once that a SIGTERM checkpoint longer than 30 s is cut. Returns whether it warned."""
    if world <= 1 or launcher_honours_shutdown_timeout():
        return False
    log.warning("torch %s's launcher sends SIGKILL 30 s after SIGTERM (it ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT): a "
                "SIGTERM checkpoint that takes longer is lost; a torch with LaunchConfig.shutdown_timeout waits, and "
                "train.checkpoint_minutes keeps time checkpoints meanwhile", torch.__version__)
    return True


class StopOnSigterm:
    """While active, SIGTERM only sets `requested`: the loop checkpoints and stops
    after the current step. Repeats are ignored (SLURM signals every process of
    the step, and the launcher forwards its own copy; SIGINT or SIGKILL still stop
    at once)."""

    def __init__(self):
        self.requested, self._previous = False, None

    def _handle(self, signum, frame):
        if not self.requested:
            log.warning("SIGTERM: writing a checkpoint after this step, then stopping")
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def any_process(acc, world: int, *flags: bool) -> list[bool]:
    """Each flag, true when it is true on any process (one tiny all-reduce)."""
    if world == 1:
        return list(flags)
    t = torch.tensor([float(f) for f in flags], device=acc.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]

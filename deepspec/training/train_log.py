"""train_log.csv, one row per logged training step, written by the main process;
the same rows as TensorBoard scalars through accelerate's tracker
(<out>/tensorboard/<run>/, `start_tensorboard`)."""
from __future__ import annotations

import csv
import importlib.util
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Columns every train_log.csv has around the step function's metrics.
HEAD_COLS = ["step", "epoch", "lr", "loss"]
TAIL_COLS = ["grad_norm", "positions_per_s", "sequences_per_s", "elapsed_s"]
TIMING_COLS = ("positions_per_s", "sequences_per_s", "elapsed_s")
TB_DIR = "tensorboard"  # in a training run's output directory: its TensorBoard event files


class TrainLog:
    """train_log.csv, written by the main process one row at a time (flushed).
    The columns are fixed by the first row's metrics. With `acc` (an Accelerator
    whose trackers `start_tensorboard` started) every row also goes to its
    trackers, each column but the step a scalar at the row's step."""

    def __init__(self, path: Path, enabled: bool, acc=None):
        self.path, self.enabled, self.cols, self.acc = path, enabled, None, acc
        if enabled and path.exists():
            with open(path, newline="") as f:
                self.cols = next(csv.reader(f), None)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.cols is None:
            metric_cols = [k for k in row if k not in HEAD_COLS and k not in TAIL_COLS]
            self.cols = HEAD_COLS + metric_cols + TAIL_COLS
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.cols)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(row.get(c, float("nan"))) for c in self.cols])
            f.flush()
        if self.acc is not None and self.acc.trackers:
            self.acc.log({k: float(v) for k, v in row.items() if k != "step"}, step=int(row["step"]))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


def tensorboard_available() -> bool:
    """Whether accelerate's TensorBoard tracker can write: it takes
    torch.utils.tensorboard (the `tensorboard` package) or `tensorboardX`."""
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def start_tensorboard(acc, run_name: str, resumed_at: int = 0) -> None:
    """Open the TensorBoard run <project_dir>/<run_name> of `acc` (an Accelerator
    made with log_with="tensorboard", `loop.make_accelerator`'s log_dir; nothing
    otherwise). Every start writes a new event file beside the earlier ones;
    after a resume at step `resumed_at` the events of later steps that the
    interrupted run wrote are purged (SummaryWriter's purge_step), as
    train_log.csv goes back to its checkpoint's rows. A writer that cannot
    start (a broken install) is one warning: training goes on without it."""
    if not acc.log_with:
        return
    kwargs = {"tensorboard": {"purge_step": resumed_at + 1}} if resumed_at else {}
    try:
        acc.init_trackers(run_name, init_kwargs=kwargs)
    except ImportError as e:
        acc.trackers = []
        if acc.is_main_process:
            log.warning("no TensorBoard logging (%s); train_log.csv has the same rows", e)


def finish_tensorboard(acc) -> None:
    """Close `acc`'s trackers (their event files flushed). Not
    `Accelerator.end_training`: that also ends the process group, which the
    loop and its caller still use."""
    for tracker in acc.trackers:
        tracker.finish()
    acc.trackers = []

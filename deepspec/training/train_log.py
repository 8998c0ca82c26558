"""train_log.csv: one row per logged training step, written by the main process."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

# Columns every train_log.csv has around the step function's metrics.
HEAD_COLS = ["step", "epoch", "lr", "loss"]
TAIL_COLS = ["grad_norm", "positions_per_s", "sequences_per_s", "elapsed_s"]
TIMING_COLS = ("positions_per_s", "sequences_per_s", "elapsed_s")


class TrainLog:
    """train_log.csv, written by the main process one row at a time (flushed).
    The columns are fixed by the first row's metrics."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled, self.cols = path, enabled, None
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


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)

"""The run's learning, where users look for it: each trained drafter's training
curves (its train_log.csv) as a figure beside Figure 2 and as REPORT.md's
"Training" section, with the TensorBoard command for every column."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pandas as pd

from .. import paper
from ..files import pyplot, save_figure
from ..paths import RunPaths
from ..settings import Settings
from ..training.checkpoints import LOG_NAME

log = logging.getLogger(__name__)


# the training figure's panels: train_log.csv column, title
TRAINING_CURVES = [("loss", "training loss"), ("c_star_1", "c*₁: position-1 acceptance"),
                   ("tau_expected", "expected τ")]



def training_logs(s: Settings) -> dict[str, pd.DataFrame]:
    """Each trained drafter's train_log.csv (the train rule's), in train.methods'
    order. A released checkpoint (eval.released_checkpoints) was not trained here
    and has none; a trained drafter whose log is missing or unreadable is left
    out with a warning."""
    paths, released = RunPaths.of(s), s.eval.released_checkpoints
    logs = {}
    for method in (m for m in s.train.methods if m not in released):
        path = paths.drafter_dir(method) / LOG_NAME
        try:
            logs[method] = pd.read_csv(path)
        except (OSError, ValueError) as e:  # missing; pandas' EmptyDataError and ParserError are ValueErrors
            log.warning("%s: no training curve for %s (%s)", path, method, str(e).strip().splitlines()[0])
    return logs



def plot_training(logs: dict[str, pd.DataFrame], pdf: Path, png: Path | None = None, title: str = "") -> None:
    """The training curves against the optimiser step, one line per drafter
    (`TRAINING_CURVES`): the loss, c*_1 (the expected acceptance sum min(p_d, p_t)
    of draft position 1) and the expected tau, all on the training batches,
    teacher-forced: a view of the learning, not held-out numbers (Table 1 and
    Figure 2 are those). A drafter whose log lacks a column has no line there."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(TRAINING_CURVES), figsize=(4.2 * len(TRAINING_CURVES), 3.4), squeeze=False)
    for ax, (col, label) in zip(axes[0], TRAINING_CURVES):
        for method, df in logs.items():
            if col in df:
                ax.plot(df["step"], df[col], color=paper.METHOD_COLORS.get(method), lw=1.5, ms=3,
                        marker=paper.METHOD_MARKERS.get(method, "o") if len(df) <= 30 else None,
                        label=paper.METHOD_LABEL.get(method, method))
        ax.set_xlabel("Optimiser step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    if logs:
        axes[0][0].legend(fontsize=8)
    else:
        axes[0][1].text(0.5, 0.5, "no drafter trained here", ha="center", va="center", transform=axes[0][1].transAxes)
    fig.suptitle((title + "\n" if title else "") + "on the training batches (teacher-forced), not held out", fontsize=8)
    fig.tight_layout()
    save_figure(fig, pdf, *([png] if png else []))
    plt.close(fig)



def training_markdown(s: Settings, logs: dict[str, pd.DataFrame], figure: Path, report: Path) -> list[str]:
    """REPORT.md's "Training" section: the training figure (linked relative to
    the report), what its lines are, each drafter's first and last logged values,
    the released checkpoints that were not trained, and where TensorBoard finds
    every column of the logs."""
    released = [m for m in s.train.methods if m in s.eval.released_checkpoints]
    drafters_dir = RunPaths.of(s).drafter_dir("_").parent
    lines = ["## Training", "", f"![training curves]({Path(os.path.relpath(figure, report.parent)).as_posix()})", "",
             "Each trained drafter's `train_log.csv` against the optimiser step: the loss (each method's own "
             "objective, so its level does not compare across methods), c*₁ (the expected acceptance "
             "Σ min(p_d, p_t) of draft position 1) and the expected τ = 1 + Σ_k Π_{i≤k} c*_i. "
             "They are measured on the training batches, teacher-forced: they show the learning, not held-out "
             "acceptance (that is Table 1 and Figure 2).", ""]
    if logs:
        lines += ["| drafter | steps | loss (first → last) | c*₁ | expected τ |", "|---|---|---|---|---|"]
        for method, df in logs.items():
            cells = [f"{df[c].iloc[0]:.3f} → {df[c].iloc[-1]:.3f}" if c in df and len(df) else "n/a"
                     for c, _ in TRAINING_CURVES]
            steps = int(df["step"].iloc[-1]) if len(df) else 0
            lines.append(f"| {paper.METHOD_LABEL.get(method, method)} | {steps} | " + " | ".join(cells) + " |")
        lines.append("")
    if released:
        lines += [f"Not trained here (released checkpoints, eval.released_checkpoints): {', '.join(released)}.", ""]
    lines += [f"Every column of the logs as TensorBoard scalars: `tensorboard --logdir {drafters_dir}`.", ""]
    return lines

"""The ablation rules (workflow/rules/ablations.smk), on demand: depth
(Fig. 3), draft length (Fig. 4), confidence-threshold sweep (Fig. 5) and
calibration before/after STS (Fig. 6).

Each figure has a tidy CSV (default <results>/tables/) and a PDF with a PNG
beside it (default figures/); the rules pass both paths.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from .. import paper
from ..errors import DeepSpecError
from ..files import pyplot, read_json, save_figure, write_csv_atomic
from ..methods import fig3_methods, fig4_methods, method_settings, variant_base
from ..paths import RunPaths
from ..settings import Settings

log = logging.getLogger(__name__)


def tau_table(s: Settings, methods: list[str]) -> pd.DataFrame:
    """tau with its CI per variant and benchmark, from evaluate's summaries."""
    paths, rows = RunPaths.of(s), []
    for method in methods:
        base, vs = method_settings(s, method)
        variant = vs.drafter  # the variant's drafter section (block size, depth)
        for bench, spec in s.data.benchmarks.items():
            summary = read_json(paths.summary(method, bench), f"evaluation summary not found: {paths.summary(method, bench)}")
            rows.append(dict(method=method, benchmark=bench, domain=spec["domain"], tau=summary["tau"],
                             tau_ci_low=summary["tau_ci_low"], tau_ci_high=summary["tau_ci_high"],
                             block_size=variant.block_size, layers=variant.num_layers.get(base)))
    return pd.DataFrame(rows)


def _save(fig, pdf: Path) -> None:
    save_figure(fig, pdf, pdf.with_suffix(".png"))


def fig3(s: Settings, out_csv: Path, out_pdf: Path) -> pd.DataFrame:
    df = tau_table(s, fig3_methods(s))
    plt = pyplot()
    benches = list(s.data.benchmarks)
    methods = list(dict.fromkeys(df["method"]))
    fig, ax = plt.subplots(figsize=(10, 3.4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        d = df[df.method == m].set_index("benchmark").reindex(benches)
        label = ("DFlash" if m.startswith("dflash") else "DSpark") + f" {int(d['layers'].iloc[0])}L"
        ax.bar(np.arange(len(benches)) + (i - (len(methods) - 1) / 2) * width, d["tau"], width, label=label,
               yerr=[d["tau"] - d["tau_ci_low"], d["tau_ci_high"] - d["tau"]], capsize=2)
    ax.set_xticks(range(len(benches)), [paper.BENCHMARK_LABEL.get(b, b) for b in benches], fontsize=8)
    ax.set_ylabel("Accepted length τ")
    ax.set_title("Drafter depth (paper Figure 3)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out_pdf)
    return df


def fig4(s: Settings, out_csv: Path, out_pdf: Path) -> pd.DataFrame:
    df = tau_table(s, fig4_methods(s))
    heads = {"dspark": "DSpark (Markov)", "dspark_rnn": "DSpark (RNN)", "dflash": "DFlash"}
    df["head"] = df["method"].map(lambda m: heads[variant_base(m)])
    df["draft_length"] = df["block_size"] + 1
    dom = df.groupby(["head", "domain", "draft_length"], as_index=False)["tau"].mean()
    plt = pyplot()
    domains = [d for d in ["Math", "Code", "Chat"] if d in set(dom.domain)]
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.2), squeeze=False)
    for ax, d in zip(axes[0], domains):
        for head, g in dom[dom.domain == d].groupby("head"):
            ax.plot(g["draft_length"], g["tau"], marker="o", label=head)
        ax.set_title(d)
        ax.set_xlabel("Draft length (block + 1)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("τ (domain mean)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out_pdf)
    return df


def _per_benchmark_files(s: Settings, suffix: str) -> dict[str, pd.DataFrame]:
    d = RunPaths.of(s).eval_dir() / "dspark"
    found = {p.name[: -len(suffix)]: pd.read_csv(p) for p in sorted(d.glob(f"*{suffix}"))}
    if not found:
        raise DeepSpecError(f"no {suffix} files under {d} (run the schedule rule first)")
    return found


def fig5(s: Settings, out_csv: Path, out_pdf: Path) -> pd.DataFrame:
    sweeps = _per_benchmark_files(s, ".sweep.csv")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.2), squeeze=False)
    for ax, (bench, sweep) in zip(axes[0], sweeps.items()):
        x = np.arange(len(sweep))
        ax.bar(x - 0.2, sweep["proposed"], 0.4, label="tokens per step", color="#9ecae1")
        ax.bar(x + 0.2, sweep["accepted"], 0.4, label="accepted per step", color="#3182bd")
        ax.set_xticks(x, [f"{t:.1f}" for t in sweep["threshold"]], fontsize=7)
        ax.set_xlabel("Confidence threshold")
        ax.set_title(paper.BENCHMARK_LABEL.get(bench, bench))
        ax2 = ax.twinx()
        ax2.plot(x, 100 * sweep["acceptance_rate"], color="#d62728", marker="o", ms=3)
        ax2.set_ylabel("Acceptance rate (%)", color="#d62728")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    _save(fig, out_pdf)
    return pd.concat([sweep.assign(benchmark=b) for b, sweep in sweeps.items()], ignore_index=True)


def fig6(s: Settings, out_csv: Path, out_pdf: Path) -> pd.DataFrame:
    cals = _per_benchmark_files(s, ".calibration.csv")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(cals), figsize=(4.2 * len(cals), 3.2), squeeze=False)
    for ax, (bench, c) in zip(axes[0], cals.items()):
        x = c["position"].to_numpy()
        ax.bar(x - 0.2, 100 * c["ece_before"], 0.4, label="ECE raw", color="#fdae6b")
        ax.bar(x + 0.2, 100 * c["ece_after"], 0.4, label="ECE after STS", color="#e6550d")
        for xi, a in zip(x, c["auroc"]):
            ax.annotate(f"{a:.2f}", (xi, 0), textcoords="offset points", xytext=(0, -18), ha="center", fontsize=6)
        ax.set_xlabel("Draft position (AUROC below)")
        ax.set_ylabel("ECE of Π c_i (%)")
        ax.set_title(paper.BENCHMARK_LABEL.get(bench, bench))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    _save(fig, out_pdf)
    return pd.concat([c.assign(benchmark=b) for b, c in cals.items()], ignore_index=True)


FIGURES = {"fig3": fig3, "fig4": fig4, "fig5": fig5, "fig6": fig6}


def cli_plot(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec plot", description=__doc__)
    p.add_argument("figure", choices=sorted(FIGURES))
    add_config_args(p)
    p.add_argument("--csv", help="table output (default <results>/tables/<figure>.csv)")
    p.add_argument("--pdf", help="figure output, a PNG is written beside it (default figures/<figure>.pdf)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    s, paths = Settings.of(cfg), RunPaths.of(cfg)
    out_csv = Path(args.csv) if args.csv else paths.table(f"{args.figure}.csv")
    out_pdf = Path(args.pdf) if args.pdf else paths.figure(f"{args.figure}.pdf")
    df = FIGURES[args.figure](s, out_csv, out_pdf)
    write_csv_atomic(df, out_csv)
    log.info("wrote %s and %s", out_csv, out_pdf)
    return 0

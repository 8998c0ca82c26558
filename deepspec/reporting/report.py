"""The report rule (workflow/rules/report.smk): Table 1, Figure 2 and
REPORT.md from the evaluation outputs.

Inputs (`deepspec.paths`; R = results_dir, T = target name):
  R/T/eval/<method>/<benchmark>.json  evaluate's summary: tau with its CI, tokens/s
  R/T/eval/<method>/<benchmark>.csv   per-round records (Figure 2)
  R/T/eval/baseline/<benchmark>.json  plain / prompt-lookup tokens/s
  R/T/drafters/<method>/train_log.csv  the training curves (trained drafters only)
Outputs (given on the command line by the rule):
  table1.csv (tidy), table1.md (the paper's wide layout), fig2.csv,
  fig2.pdf / .png, training.pdf / .png (the training curves), REPORT.md,
  provenance.json (deepspec.provenance: what the results were made with;
  REPORT.md's "Provenance" section)
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from .. import paper
from ..core.acceptance import domain_position_table
from ..data.prompts import speed_benchmarks
from ..files import (
    json_safe,
    pyplot,
    read_json,
    save_figure,
    write_csv_atomic,
    write_json_atomic,
    write_text_atomic,
)
from ..paths import RunPaths
from ..settings import Settings
from .claims import MIN_ATTEMPTS, figure_line, judge_claims, verdict
from .records import check_settings, load_records, read_summary
from .run_record import collect as collect_provenance
from .run_record import provenance_markdown
from .served import served_markdown
from .training_curves import plot_training, training_logs, training_markdown

log = logging.getLogger(__name__)

TABLE1_COLUMNS = ["target", "method", "benchmark", "domain", "n_samples", "rounds", "tau", "tau_ci_low",
                  "tau_ci_high", "verify_rate", "tokens_per_s", "plain_tokens_per_s", "speedup", "speedup_ci_low",
                  "speedup_ci_high",
                  "speedup_alg1", "speedup_alg1_ci_low", "speedup_alg1_ci_high"]
# survival: the unconditional P(accepted >= k | proposed >= k), what vLLM and speculators report
FIG2_COLUMNS = ["target", "method", "domain", "position", "attempts", "accepted", "acceptance", "ci_low", "ci_high",
                "survival"]
# The Rao-Blackwellised estimate of the same rate (core.acceptance.per_sample_rb_sums):
# every round that verified position k contributes, weighted by the probability
# that it reached k; NaN when the records lack the per-position probabilities.
FIG2_RB_COLUMNS = ["expected_attempts", "acceptance_rb", "rb_ci_low", "rb_ci_high"]


# A speedup is judged from this many timed prompts on: a percentile bootstrap over fewer
# is little more than their range (the result preset times 15, the quick default 3)
MIN_SPEED_PROMPTS = 10


def _baseline_tps(paths: RunPaths, bench: str, which: str, s: Settings | None = None) -> float:
    path = paths.baseline(bench)
    summary = read_json(path, default={})
    if s is not None and summary:
        check_settings(s, summary, path, "baseline")
    b = summary.get(which, {})
    return float(b.get("tokens_per_s", np.nan)) if isinstance(b, dict) else np.nan


def _nan(v) -> float:
    return np.nan if v is None else v


def build_table1(cfg) -> pd.DataFrame:
    """One row per method x benchmark from evaluate's summaries (tau and its CI
    are computed there, once), plus the drafter-free baselines' tokens/s. `cfg`:
    a config or its Settings."""
    st = Settings.view(cfg)
    t, paths = st.target.name, RunPaths.of(st)
    rows = []
    for bench, spec in st.data.benchmarks.items():
        plain = _baseline_tps(paths, bench, "plain", st)
        for method in st.train.methods:
            s = read_summary(paths, method, bench)
            check_settings(st, s, paths.summary(method, bench), "evaluate")
            tps = float(_nan(s.get("tokens_per_s", np.nan)))
            # the speedup over plain decoding of the same prompts, timed back to back (evaluate), else
            # over the baseline job's separate timing of them
            inter = s.get("speedup_interleaved") or {}
            alg1 = s.get("speedup_alg1") or {}  # the same prompts decoded with Algorithm 1 (DSpark)
            rows.append(dict(target=t, method=method, benchmark=bench, domain=spec["domain"],
                             n_samples=s["n_samples_with_rounds"], rounds=s["rounds"], tau=_nan(s["tau"]),
                             tau_ci_low=_nan(s["tau_ci_low"]), tau_ci_high=_nan(s["tau_ci_high"]),
                             verify_rate=_nan(s["verify_rate"]), tokens_per_s=tps,
                             plain_tokens_per_s=inter.get("plain_tokens_per_s", plain),
                             speedup=inter.get("speedup", tps / plain),
                             speedup_ci_low=inter.get("ci_low", np.nan), speedup_ci_high=inter.get("ci_high", np.nan),
                             speedup_alg1=alg1.get("speedup", np.nan), speedup_alg1_ci_low=alg1.get("ci_low", np.nan),
                             speedup_alg1_ci_high=alg1.get("ci_high", np.nan),
                             tau_selfcheck=_nan(s["tau_selfcheck"]),
                             skipped_prompts=s.get("n_skipped_prompts", 0)))
        for which in st.eval.baselines:
            tps = _baseline_tps(paths, bench, which)
            if not np.isnan(tps):
                rows.append(dict(target=t, method=which, benchmark=bench, domain=spec["domain"],
                                 tokens_per_s=tps, plain_tokens_per_s=plain, speedup=tps / plain))
    # skipped_prompts: the benchmark's prompts over data.max_prompt_tokens, left out of every method and baseline
    t1 = pd.DataFrame(rows, columns=TABLE1_COLUMNS + ["tau_selfcheck", "skipped_prompts"])
    # counts stay integers in table1.csv, empty on the baselines' rows
    return t1.astype({c: "Int64" for c in ("n_samples", "rounds", "skipped_prompts")})


def speed_claims(s: Settings) -> list[str]:
    """Per drafter, its speedup over plain decoding at batch size 1 pooled over
    every timed prompt (evaluate decodes each both ways back to back): the ratio
    of the pooled tokens/s with a paired-bootstrap 95 % interval over prompts, and
    whether speculation is faster (the interval above 1; judged from MIN_SPEED_PROMPTS prompts on);
    for a drafter with a confidence head, the same for its decoding with Algorithm 1
    (eval.speed_alg1). The bootstrap is stratified by benchmark where every timed
    benchmark gives at least 2 prompts, else plain over the prompts.
    Empty when nothing was timed both ways."""
    from ..evaluation.evaluate import interleaved_speedup

    paths, out = RunPaths.of(s), []
    for method in s.train.methods:
        samples, strata = [], []
        for bench in speed_benchmarks(s):
            got = read_json(paths.summary(method, bench), default={}).get("samples") or []
            samples += got
            strata += [bench] * len(got)
        label = paper.METHOD_LABEL.get(method, method)
        for policy, how in [("fixed", f"all {s.drafter.block_size} drafts verified"),
                            ("alg1", "Algorithm 1 choosing the verified length")]:
            sp = interleaved_speedup(samples, s.eval.n_boot, s.eval.seed, policy, strata)
            if sp is None:
                continue
            extra = f", {sp['mean_verified']:.2f} drafts verified per round" if policy == "alg1" else ""
            if sp["n_samples"] < MIN_SPEED_PROMPTS:
                ci = "" if sp["n_samples"] < 2 else f" [{sp['ci_low']:.2f}, {sp['ci_high']:.2f}]"
                out.append(f"**{label} ({how}) faster than plain decoding: not judged** ({sp['n_samples']} timed "
                           f"prompt{'s' if sp['n_samples'] > 1 else ''}: a bootstrap over fewer than "
                           f"{MIN_SPEED_PROMPTS} understates its interval). {sp['speedup']:.2f}×{ci} (plain "
                           f"{sp['plain_tokens_per_s']:.1f} tokens/s{extra})")
                continue
            faster = bool(sp["ci_low"] > 1)  # as the claims: holds when the interval excludes 1 on the claimed side
            out.append(f"**{label} ({how}) faster than plain decoding: {verdict(faster)}.** "
                       f"{sp['speedup']:.2f}× [{sp['ci_low']:.2f}, {sp['ci_high']:.2f}] over {sp['n_samples']} prompts "
                       f"(plain {sp['plain_tokens_per_s']:.1f} tokens/s{extra}; {sp['bootstrap']} bootstrap)")
    return out


def build_fig2(cfg, gamma: int | None = None, records: dict | None = None) -> pd.DataFrame:
    """Figure 2 per method and domain (`core.acceptance.domain_position_table`:
    each benchmark's conditional acceptance averaged over the domain, count and
    Rao-Blackwellised estimates, bootstrap intervals of the average). `cfg`: a
    config or its Settings."""
    s = Settings.view(cfg)
    gamma = gamma or s.drafter.block_size
    records = records or load_records(s)
    parts = []
    for method, by_domain in records.items():
        for domain, recs in by_domain.items():
            table = domain_position_table(recs, gamma, n_boot=s.eval.n_boot, seed=s.eval.seed)
            parts.append(table.assign(target=s.target.name, method=method, domain=domain))
    return pd.concat(parts, ignore_index=True)[FIG2_COLUMNS + FIG2_RB_COLUMNS]


def table1_markdown(t1: pd.DataFrame, s: Settings) -> str:
    """The paper's wide layout: one row per method, benchmarks as columns,
    plus the macro mean; the paper's value beside ours where it has one."""
    paper_name = s.target.paper_name
    benches = [b for b in paper.BENCHMARK_ORDER if b in s.data.benchmarks] + \
        [b for b in s.data.benchmarks if b not in paper.BENCHMARK_ORDER]
    head = ["Drafter"] + [paper.BENCHMARK_LABEL.get(b, b) for b in benches] + ["Macro", "Speedup"]
    lines = [f"**{s.target.name}**: accepted length τ per round (bonus included), T = "
             f"{s.as_written('eval', 'temperature')}, block {s.drafter.block_size}"
             + (f"; paper value ({paper_name}) in parentheses" if paper_name else "")
             + f"; speedup over plain decoding at batch size 1, {_speed_scope(s)}, the mean of the timed "
             "benchmarks' own (not in the paper)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    drafts = t1[t1["tau"].notna()]
    for method in s.train.methods:
        d = drafts[drafts["method"] == method].set_index("benchmark")
        cells = []
        for b in benches:
            v = d["tau"].get(b, np.nan)
            pv = paper.TABLE1.get((paper_name, method, b)) if paper_name else None
            cells.append(f"{v:.2f}" + (f" ({pv:.2f})" if pv is not None else ""))
        macro = d["tau"].reindex(benches).mean()
        pm = [paper.TABLE1.get((paper_name, method, b)) for b in benches] if paper_name else []
        pm_s = f" ({np.mean(pm):.2f})" if pm and None not in pm else ""
        sp = d["speedup"].reindex(benches).mean()
        sa = d["speedup_alg1"].reindex(benches).mean()
        lines.append(f"| {paper.METHOD_LABEL.get(method, method)} | " + " | ".join(cells)
                     + f" | {macro:.2f}{pm_s} | " + ("n/a" if np.isnan(sp) else f"{sp:.2f}×")
                     + ("" if np.isnan(sa) else f" (Algorithm 1: {sa:.2f}×)") + " |")
    return "\n".join(lines) + "\n"


def fig2_curves(fig2: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The curve Figure 2 and the claims use: the Rao-Blackwellised estimate
    when every row has it, else the count estimate. Returns the rows with
    columns rate, low, high, n (expected attempts or attempts) and its name."""
    rb = "acceptance_rb" in fig2 and fig2["acceptance_rb"].notna().any() and fig2["expected_attempts"].notna().all()
    cols = (["acceptance_rb", "rb_ci_low", "rb_ci_high", "expected_attempts"] if rb
            else ["acceptance", "ci_low", "ci_high", "attempts"])
    out = fig2.rename(columns=dict(zip(cols, ["rate", "low", "high", "n"])))
    return out, ("Rao-Blackwellised" if rb else "count")


def plot_fig2(fig2: pd.DataFrame, pdf: Path, png: Path | None = None, title: str = "", min_attempts: int = 10,
              paper_reference: bool = False, claims_line: str = "") -> None:
    """The paper's Figure 2 layout, the domains on one shared y-axis. The line
    and band are the Rao-Blackwellised estimate and its 95 % interval when the
    records carry it (`fig2_curves`); hollow markers are the count estimate
    (accepted / attempts). Positions with fewer than `min_attempts` (expected)
    attempts pooled over the domain are not drawn: their rates are noise.
    `paper_reference` draws the paper's Figure 2 (Qwen3-4B) as faint dashed
    lines; `claims_line` (which claims hold) goes under the panels."""
    plt = pyplot()

    colors, markers = paper.METHOD_COLORS, paper.METHOD_MARKERS
    curves, kind = fig2_curves(fig2)
    domains = [d for d in ["Math", "Code", "Chat"] if d in set(fig2["domain"])]
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.6), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        sub = curves[curves["domain"] == domain]
        for method in [m for m in paper.METHOD_ORDER if m in set(sub["method"])] + \
                sorted(set(sub["method"]) - set(paper.METHOD_ORDER)):
            d = sub[(sub["method"] == method) & (sub["n"] >= min_attempts)].sort_values("position")
            c = colors.get(method)
            ax.plot(d["position"], d["rate"], marker=markers.get(method, "o"), color=c, lw=1.8, ms=5,
                    label=paper.METHOD_LABEL.get(method, method))
            ax.fill_between(d["position"], d["low"], d["high"], color=c, alpha=0.15, lw=0)
            if kind != "count":
                e = d[d["attempts"] >= min_attempts]
                ax.plot(e["position"], e["acceptance"], ls="none", marker=markers.get(method, "o"), ms=7,
                        mfc="none", mec=c, alpha=0.7)
            ref = paper.FIG2.get((domain, method)) if paper_reference else None
            if ref:
                ax.plot(range(1, len(ref) + 1), ref, ls="--", lw=1.0, color=c, alpha=0.35)
        ax.set_title(domain)
        ax.set_xlabel("Draft position")
        ax.set_xlim(0.7, fig2["position"].max() + 0.3)
        ax.set_xticks(sorted(set(sub["position"])))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("Conditional acceptance")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    note = (f"lines: {kind} estimate, 95 % bootstrap band" + ("; hollow: accepted / attempts" if kind != "count" else "")
            + (f"; dashed: the paper ({paper.FIG2_TARGET})" if paper_reference else "")
            + f"; positions with < {min_attempts} {'expected ' if kind != 'count' else ''}attempts omitted")
    fig.suptitle((title + "\n" if title else "") + note, fontsize=8)
    if claims_line:
        fig.text(0.5, 0.01, claims_line, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.06 if claims_line else 0, 1, 1))
    save_figure(fig, pdf, *([png] if png else []))
    plt.close(fig)


def _estimator_notes(fig2: pd.DataFrame) -> list[str]:
    """What the claims below rest on: the estimator and the widest interval at the last position."""
    curves, kind = fig2_curves(fig2)
    n_word = "expected attempts" if kind != "count" else "attempts"
    out = [f"Estimator: the {kind} estimate of the conditional acceptance"
           + (" (every verified round counts at every position, weighted by the probability that it got there; "
              "same quantity as accepted / attempts, lower variance)." if kind != "count" else ".")]
    judged = curves[curves["n"] >= MIN_ATTEMPTS].assign(half=lambda d: (d["high"] - d["low"]) / 2)
    if judged.empty or judged["half"].isna().all():
        out.append(f"No point rests on {MIN_ATTEMPTS} {n_word}: none is judged.")
        return out
    w = judged.loc[judged["half"].idxmax()]
    out.append(f"Widest 95 % half-interval among the judged points (at least {MIN_ATTEMPTS} {n_word}): "
               f"±{w['half']:.2f}, {paper.METHOD_LABEL.get(w['method'], w['method'])} {w['domain']} position "
               f"{int(w['position'])} ({w['n']:.{0 if kind == 'count' else 1}f} {n_word}). The intervals of points "
               "under the bar are left out: too few rounds behind them to trust a bootstrap.")
    return out


def _speed_scope(s: Settings) -> str:
    """Which prompts the speedup was timed on (eval.speed_prompts of eval.speed_benchmarks)."""
    timed, n = speed_benchmarks(s), s.eval.speed_prompts
    if not timed:
        return "not timed (eval.speed_prompts is 0)"
    # a benchmark capped below eval.speed_prompts times all its prompts
    count = {b: min(n, s.data.benchmarks[b].get("cap") or n) for b in timed}
    label = {b: paper.BENCHMARK_LABEL.get(b, b) for b in timed}
    if len(set(count.values())) > 1:
        return "timed on the first " + ", ".join(f"{count[b]} of {label[b]}" for b in timed) + " prompts"
    k = next(iter(count.values()))
    which = "every benchmark" if len(timed) == len(s.data.benchmarks) else ", ".join(label.values())
    return f"timed on the first {k} prompts of {which}" if k != 1 else f"timed on the first prompt of {which}"


def _draft_layers(s: Settings) -> str:
    """drafter.layer_arch in words: whose layer classes each method's draft layers are."""
    from ..architectures import layer_arch_of
    from ..methods import method_settings

    names = {"target": "the target's layer type", "qwen3": "Qwen3 layers"}
    per = {}
    for m in s.train.methods:
        base, ms = method_settings(s, m)
        per.setdefault(names[layer_arch_of(ms.drafter, base)], []).append(m)
    if len(per) == 1:
        return f"draft layers: {next(iter(per))}"
    return "draft layers: " + "; ".join(f"{', '.join(ms)}: {what}" for what, ms in per.items())


def _per_method(v) -> str:
    """A setting as written, a per-method mapping as "eagle3 200, dflash 900"."""
    return ", ".join(f"{k} {x}" for k, x in v.items()) if isinstance(v, dict) else str(v)


def _skipped_note(t1: pd.DataFrame) -> str:
    """The prompts left out of every method for being over data.max_prompt_tokens, per benchmark."""
    per = t1.dropna(subset=["skipped_prompts"]).groupby("benchmark", sort=False)["skipped_prompts"].max()
    per = per[per > 0]
    if per.empty:
        return ""
    return (" Left out, over data.max_prompt_tokens: " + ", ".join(f"{int(n)} of {b}" for b, n in per.items())
            + " (table1.csv `skipped_prompts`).")


def write_report(s: Settings, t1: pd.DataFrame, fig2: pd.DataFrame, path: Path, claims: list | None = None,
                 provenance: dict | None = None, training: list[str] | None = None) -> None:
    """REPORT.md; `training`: its "Training" section (`training_markdown`)."""
    drafts = t1[t1["tau"].notna()]
    macro = drafts.groupby("method")[["tau", "tau_selfcheck", "speedup"]].mean()
    f2 = fig2.pivot_table(index=["method", "domain"], columns="position", values="acceptance").round(3)
    att = fig2.pivot_table(index=["method", "domain"], columns="position", values="attempts")
    has_rb = fig2_curves(fig2)[1] != "count"
    lines = [
        f"# DeepSpec replication report: {s.target.name}", "",
        f"Preset `{s.preset}`: {s.description}", "",
        "## Setup", "",
        f"- Target `{s.target.spec}`, feature layers {s.target.feature_layers}, dtype {s.target.dtype}.",
        f"- Drafters: {', '.join(s.train.methods)}; block {s.drafter.block_size}, layers "
        f"{_per_method(s.drafter.num_layers)} ({_draft_layers(s)}), Markov rank {s.drafter.markov_rank}.",
        f"- Training: {s.as_written('train', 'epochs')} epochs"
        + (f" or max_steps {_per_method(s.as_written('train', 'max_steps'))}, whichever ends first (the "
           "Training section gives the steps each drafter ran)" if s.train.max_steps else "")
        + f", global batch {s.train.global_batch}, lr {_per_method(s.as_written('train', 'lr'))}, "
        f"{s.train.num_anchors} anchors per sequence.",
        f"- Evaluation: T = {s.as_written('eval', 'temperature')}, max new tokens {s.eval.max_new_tokens}, caps "
        + ", ".join(f"{b} {spec['cap']}" for b, spec in s.data.benchmarks.items()) + "." + _skipped_note(t1), "",
        "## Table 1", "", table1_markdown(t1, s), "",
        "Macro means over the benchmarks (τ, the self-check 1 + Σ_k Π_{i≤k} c_k from the measured conditional "
        f"rates, and speedup over plain decoding at batch size 1, {_speed_scope(s)}; the speedup pooled over "
        "every timed prompt, with its interval, is under \"Speed at batch size 1\"):", "",
        macro.round(3).to_string(), "",
        "## Figure 2: conditional acceptance per draft position", "",
        "Count estimate (accepted / attempts of each benchmark, as the paper, averaged over the domain's "
        "benchmarks):", "", f2.to_string(), "",
        "Attempts (rounds that reached the position, summed over the domain's benchmarks):", "", att.to_string(), "",
        *(["Rao-Blackwellised estimate (every verified round contributes at every position, weighted by "
           "Π_{i<k} min(1, p_t/p_d) of its drafted tokens; the curve of `figures/fig2.pdf`):", "",
           fig2.pivot_table(index=["method", "domain"], columns="position", values="acceptance_rb").round(3).to_string(),
           "", f"Its half-width of the 95 % interval (blank under {MIN_ATTEMPTS} expected attempts: not judged):", "",
           ((fig2["rb_ci_high"] - fig2["rb_ci_low"]) / 2).where(fig2["expected_attempts"] >= MIN_ATTEMPTS)
           .to_frame("h").join(fig2[["method", "domain", "position"]])
           .pivot_table(index=["method", "domain"], columns="position", values="h", dropna=False).round(3)
           .to_string(na_rep=""), ""]
          if has_rb else []),
        "## The paper's qualitative claims at this scale", "",
        *[f"- {c}" for c in _estimator_notes(fig2)], "",
        "Each claim with the 95 % interval of its difference (a paired bootstrap over prompts: every drafter's "
        "rates recomputed on the same resampled prompts); it holds when the interval excludes 0 on the claimed "
        f"side. Points with fewer than {MIN_ATTEMPTS} (expected) attempts are not judged.", "",
        *[f"- **{c.name}: {verdict(c.holds)}.** {c.text}" for c in (claims or [])], "",
        *(["## Speed at batch size 1", "",
           "Each timed prompt is decoded with the drafter and without it (plain decoding), back to back in "
           "alternating order, in the evaluation's process; the speedup is the ratio of the tokens/s pooled over "
           "every timed prompt, its interval a paired bootstrap over prompts, stratified by benchmark where each "
           "timed benchmark gives at least 2 prompts (each line names its bootstrap), judged from "
           f"{MIN_SPEED_PROMPTS} timed prompts on (not in the paper, which reports τ only). Table 1's "
           "Speedup column is instead the mean of the timed benchmarks' own speedups, as its Macro is of "
           "their τ. A drafter "
           "with a confidence head also decodes each between the two with Algorithm 1 (Sec. 3.2.2): each "
           "round verifies the prefix that maximises (1 + Σ_{j≤ℓ} Π_{i≤j} σ(c_i)) · SPS(1 + ℓ), SPS this "
           "machine's batch-1 verification speed over 1 + ℓ tokens, profiled at the evaluation's start; "
           "those rounds are timed only (τ and Figure 2 verify full proposals, as the paper's Table 1).", "",
           *[f"- {c}" for c in speed], ""] if (speed := speed_claims(s)) else []),
        *(training or []),
        *served_markdown(s),
        *(provenance_markdown(provenance) if provenance else []),
    ]
    write_text_atomic(path, "\n".join(lines))


# the report's outputs: command-line flag -> default path under the preset's directories
OUTPUTS = {
    "table1": lambda p: p.table("table1.csv"),
    "table1-md": lambda p: p.table("table1.md"),
    "fig2-csv": lambda p: p.table("fig2.csv"),
    "fig2-pdf": lambda p: p.figure("fig2.pdf"),
    "fig2-png": lambda p: p.figure("fig2.png"),
    "training-pdf": lambda p: p.figure("training.pdf"),
    "training-png": lambda p: p.figure("training.png"),
    "report": lambda p: p.report(),
    "provenance": lambda p: p.provenance(),
}


def cli_report(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec report", description=__doc__)
    add_config_args(p)
    for flag in OUTPUTS:
        p.add_argument(f"--{flag}", help="output path (default: under the preset's results / figures directory)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    s = Settings.of(cfg)
    paths = RunPaths.of(cfg)
    out = {flag: Path(getattr(args, flag.replace("-", "_")) or default(paths)) for flag, default in OUTPUTS.items()}
    t1 = build_table1(s)
    records = load_records(s)
    fig2 = build_fig2(s, records=records)
    claims, _ = judge_claims(records, s.drafter.block_size, n_boot=s.eval.n_boot, seed=s.eval.seed)
    write_csv_atomic(t1, out["table1"])
    write_csv_atomic(fig2, out["fig2-csv"])
    write_text_atomic(out["table1-md"], table1_markdown(t1, s))
    plot_fig2(fig2, out["fig2-pdf"], out["fig2-png"], title=f"{s.target.name}: conditional acceptance per position",
              paper_reference=s.target.paper_name is not None, claims_line=figure_line(claims))
    provenance = collect_provenance(s)  # code, packages, hardware, dtypes, hub commits (deepspec/provenance.py)
    write_json_atomic(out["provenance"], json_safe(provenance))
    logs = training_logs(s)
    plot_training(logs, out["training-pdf"], out["training-png"], title=f"{s.target.name}: training curves")
    write_report(s, t1, fig2, out["report"], claims, provenance,
                 training_markdown(s, logs, out["training-png"], out["report"]))
    log.info("wrote %s, %s, %s, %s", out["table1"], out["fig2-pdf"], out["training-pdf"], out["report"])
    return 0

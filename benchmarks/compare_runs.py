"""Two whole runs of one preset compared on what REPORT.md judges: per drafter,
run B minus run A in macro tau and in the conditional acceptance at positions
1-3 per domain, each with a 95 % paired-bootstrap interval over prompts.

Both runs evaluate the same prompts with the same per-prompt seeds (the preset's
benchmarks and eval.seed), so one resample of prompts serves both runs' rates
(`core.acceptance.paired_replicates`, as REPORT.md pairs drafters within a run).
The interval covers the prompts, not the spread between training runs: read a
difference inside ~0.02 as no difference.

    python benchmarks/compare_runs.py RUN_A RUN_B [--preset smollm2-135m] [--methods dflash dspark]

RUN_A and RUN_B are checkouts (or results roots) holding results/<target>/eval/.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from deepspec.config import load_config
from deepspec.core.acceptance import contrast, has_rb_columns, paired_replicates, sample_sums
from deepspec.reporting.records import load_records

K = 3  # positions compared


def run_records(root: Path, preset: str, methods: list[str]) -> dict:
    """{method: {domain: [per-benchmark records]}} of the run under `root`."""
    results = root / "results" if (root / "results").is_dir() else root
    cfg = load_config(preset, {"results_dir": str(results), "train": {"methods": methods}})
    return load_records(cfg)


def compare(a: dict, b: dict, n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Rows (method, quantity, B - A, low, high, A, B) for macro tau and p1..pK per domain."""
    rows = []
    for m in a:
        dfs = [df for d in a[m] for df in a[m][d] + b[m][d]]
        kind = "rb" if all(has_rb_columns(df, K) for df in dfs) else "count"
        every = {"A": [df for d in a[m] for df in a[m][d]], "B": [df for d in b[m] for df in b[m][d]]}
        tau = paired_replicates(every, "tau", K, n_boot=n_boot, seed=seed)
        d, lo, hi = contrast(tau["B"], tau["A"])
        rows.append(dict(method=m, quantity="macro tau", diff=d, low=lo, high=hi,
                         a=float(np.asarray(tau["A"][0]).reshape(())), b=float(np.asarray(tau["B"][0]).reshape(()))))
        for dom in a[m]:
            pos = paired_replicates({"A": a[m][dom], "B": b[m][dom]}, kind, K, n_boot=n_boot, seed=seed)
            att = {r: sum(sample_sums(df, kind, K)[2].sum(0) for df in recs)
                   for r, recs in (("A", a[m][dom]), ("B", b[m][dom]))}
            for k in range(1, K + 1):
                at = lambda r: (pos[r][0][k - 1], pos[r][1][:, k - 1])  # noqa: E731
                d, lo, hi = contrast(at("B"), at("A"))
                rows.append(dict(method=m, quantity=f"{dom} p{k}", diff=d, low=lo, high=hi, a=float(at("A")[0]),
                                 b=float(at("B")[0]), attempts_a=float(att["A"][k - 1]),
                                 attempts_b=float(att["B"][k - 1])))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["eagle3", "dflash", "dspark"])
    p.add_argument("--n-boot", type=int, default=1000)
    args = p.parse_args(argv)
    a = run_records(args.run_a, args.preset, args.methods)
    b = run_records(args.run_b, args.preset, args.methods)
    print(f"B = {args.run_b}  minus  A = {args.run_a}  (95 % paired bootstrap over prompts)")
    print(f"{'method':8} {'quantity':10} {'A':>7} {'B':>7} {'B - A':>8}  interval           attempts A / B")
    for r in compare(a, b, n_boot=args.n_boot):
        att = f"  {r['attempts_a']:.0f} / {r['attempts_b']:.0f}" if "attempts_a" in r else ""
        print(f"{r['method']:8} {r['quantity']:10} {r['a']:7.3f} {r['b']:7.3f} {r['diff']:+8.3f}  "
              f"[{r['low']:+.3f}, {r['high']:+.3f}]{att}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

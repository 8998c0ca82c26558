"""Whole runs of one preset under other seeds: do REPORT.md's verdicts hold beyond
the preset's own draw?

Seed s runs the DAG with data.seed, regenerate.seed, train.seed and eval.seed all
set to s: other prompts from the same training sources and benchmarks, other
regenerated answers, another initialisation and batch order, other decoding draws.
`preset` runs the preset's own seeds. Each run has its own results_dir, figures_dir
and logs_dir under --out; a run whose REPORT.md and wall-clock record exist is reused.
Each run's claims are then judged as REPORT.md judges them
(`deepspec.reporting.claims.judge_claims` on the run's records) and tabulated: the
verdict of every claim per run, with DFlash's decay per domain and the run's wall-clock.
A claim's 95 % intervals cover one run's prompts; the spread between the rows is the
spread between whole runs, which no single REPORT.md shows.

    python benchmarks/seed_runs.py --preset smollm2-135m --seeds preset 1 2 --out results/seeds

Writes --out/seeds.csv and --out/seeds.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from deepspec.config import load_config
from deepspec.reporting.claims import judge_claims, verdict
from deepspec.reporting.records import load_records
from deepspec.settings import Settings

REPO = Path(__file__).resolve().parents[1]
SEEDED = ("data", "regenerate", "train", "eval")  # the config sections with a seed


def overrides(seed: str, run: Path) -> dict:
    """The --config of one run: its own folders, and every seed set to `seed`
    (none changed for 'preset')."""
    cfg = {"results_dir": str(run / "results"), "figures_dir": str(run / "figures"), "logs_dir": str(run / "logs")}
    if seed != "preset":
        cfg.update({section: {"seed": int(seed)} for section in SEEDED})
    return cfg


def snakemake_args(preset: str, cfg: dict) -> list[str]:
    out = [f"preset={preset}"]
    for k, v in cfg.items():
        out.append(f"{k}={json.dumps(v)}" if isinstance(v, dict) else f"{k}={v}")
    return out


def run_dag(preset: str, seed: str, run: Path, cores: str) -> float:
    """The DAG of one seed, to Figure 2 and REPORT.md; returns its wall-clock seconds
    (recorded in run/wall.json, read back when the run is already there)."""
    record = run / "wall.json"
    cfg = overrides(seed, run)
    if record.exists() and (run / "results" / "REPORT.md").exists():
        return json.loads(record.read_text())["wall_s"]
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "snakemake", "--cores", cores, str(run / "figures" / "fig2.pdf"),
           "--config", *snakemake_args(preset, cfg)]
    t0 = time.perf_counter()
    with open(run / "snakemake.log", "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"seed_runs: seed {seed} failed (see {run / 'snakemake.log'}): {' '.join(cmd)}")
    wall = time.perf_counter() - t0
    record.write_text(json.dumps({"wall_s": wall, "seed": seed}))
    return wall


def judge(preset: str, seed: str, run: Path) -> list:
    """REPORT.md's claims on this run's records."""
    s = Settings.of(load_config(preset, overrides(seed, run)))
    claims, _ = judge_claims(load_records(s), s.drafter.block_size, n_boot=s.eval.n_boot, seed=s.eval.seed)
    return claims


def table(rows: list[dict], names: list[str]) -> str:
    head = "| seed | wall-clock | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['wall_s'] / 60:.1f} min | " + " | ".join(r[n] for n in names) + " |")
    holds = {n: sum(r[n] == "holds" for r in rows) for n in names}
    lines.append("| runs where it holds | | " + " | ".join(f"{holds[n]} of {len(rows)}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--seeds", nargs="+", default=["preset", "1", "2"], help="'preset' or integers")
    ap.add_argument("--out", type=Path, default=Path("results/seeds"))
    ap.add_argument("--cores", default="all")
    args = ap.parse_args(argv)
    for s in args.seeds:
        if s != "preset" and not s.lstrip("-").isdigit():
            ap.error(f"--seeds: '{s}' is neither 'preset' nor an integer")
    out = args.out.resolve()
    rows, names, details = [], [], []
    for seed in args.seeds:
        run = out / f"seed-{seed}"
        wall = run_dag(args.preset, seed, run, args.cores)
        claims = judge(args.preset, seed, run)
        names = names or [c.name for c in claims]
        rows.append({"seed": seed, "wall_s": wall, **{c.name: verdict(c.holds) for c in claims}})
        details += [f"- seed {seed}, {c.name}: {c.text}" for c in claims]
        print(f"seed {seed}: {wall / 60:.1f} min; " + "; ".join(f"{c.name}: {verdict(c.holds)}" for c in claims),
              flush=True)
    with open(out / "seeds.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["seed", "wall_s", *names])
        w.writeheader()
        w.writerows(rows)
    md = f"# {args.preset} under other seeds\n\n{table(rows, names)}\n\n" + "\n".join(details) + "\n"
    (out / "seeds.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole runs of one preset under other seeds: do REPORT.md's verdicts hold beyond
the preset's own draw?

Seed s runs the DAG with data.seed, regenerate.seed, train.seed and eval.seed all
set to s: other prompts from the same training sources and benchmarks, other
regenerated answers, another initialisation and batch order, other decoding draws.
`preset` runs the preset's own seeds. Each run has its own results_dir, figures_dir
and logs_dir under --out. A finished run is reused while a Snakemake dry run finds it up
to date; one resumed or rerun in part is marked so, its wall-clock being its last part's.
A seed that fails is named; the others are still tabulated.
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
import io
import json
import subprocess
import sys
import time
from pathlib import Path

from deepspec.config import load_config
from deepspec.files import write_text_atomic
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


def snakemake(preset: str, cfg: dict, run: Path, cores: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--cores", cores, str(run / "figures" / "fig2.pdf"), *extra,
            "--config", *snakemake_args(preset, cfg)]


def up_to_date(preset: str, cfg: dict, run: Path) -> bool:
    """Snakemake's own judgement (a dry run): nothing of this run's Figure 2 and REPORT.md
    would rerun under today's preset and code."""
    r = subprocess.run(snakemake(preset, cfg, run, "1", "--dry-run"), cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"the dry run of {run} failed: {(r.stdout + r.stderr).strip().splitlines()[-1:]}")
    return "Nothing to be done" in r.stdout + r.stderr


def run_dag(preset: str, seed: str, run: Path, cores: str) -> dict:
    """The DAG of one seed, to Figure 2 and REPORT.md. Returns its record (run/wall.json):
    the wall-clock seconds, and whether they are the whole run's (a run resumed over
    earlier outputs, or rerun in part after a change of preset or code, times only its
    last part). A recorded run is reused only while Snakemake finds it up to date."""
    record = run / "wall.json"
    cfg = overrides(seed, run)
    if record.exists() and up_to_date(preset, cfg, run):
        return {"whole": True, **json.loads(record.read_text())}
    whole = not (run / "results").exists()
    run.mkdir(parents=True, exist_ok=True)
    cmd = snakemake(preset, cfg, run, cores)
    t0 = time.perf_counter()
    with open(run / "snakemake.log", "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"seed {seed} failed (see {run / 'snakemake.log'}): {' '.join(cmd)}")
    out = {"wall_s": time.perf_counter() - t0, "seed": seed, "whole": whole}
    write_text_atomic(record, json.dumps(out))
    return out


def judge(preset: str, seed: str, run: Path) -> list:
    """REPORT.md's claims on this run's records."""
    s = Settings.of(load_config(preset, overrides(seed, run)))
    claims, _ = judge_claims(load_records(s), s.drafter.block_size, n_boot=s.eval.n_boot, seed=s.eval.seed)
    return claims


def table(rows: list[dict], names: list[str]) -> str:
    head = "| seed | wall-clock | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for r in rows:
        wall = f"{r['wall_s'] / 60:.1f} min" + ("" if r.get("whole", True) else " (resumed: its last part only)")
        lines.append(f"| {r['seed']} | {wall} | " + " | ".join(r[n] for n in names) + " |")
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
    rows, names, details, failed = [], [], [], []
    for seed in args.seeds:
        run = out / f"seed-{seed}"
        try:
            rec = run_dag(args.preset, seed, run, args.cores)
        except RuntimeError as e:  # the other seeds still run, and are tabulated
            print(f"seed_runs: {e}", file=sys.stderr, flush=True)
            failed.append(seed)
            continue
        claims = judge(args.preset, seed, run)
        names = names or [c.name for c in claims]
        rows.append({"seed": seed, "wall_s": rec["wall_s"], "whole": rec["whole"],
                     **{c.name: verdict(c.holds) for c in claims}})
        details += [f"- seed {seed}, {c.name}: {c.text}" for c in claims]
        print(f"seed {seed}: {rec['wall_s'] / 60:.1f} min; "
              + "; ".join(f"{c.name}: {verdict(c.holds)}" for c in claims), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["seed", "wall_s", "whole", *names])
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(out / "seeds.csv", buf.getvalue())
    md = f"# {args.preset} under other seeds\n\n{table(rows, names)}\n\n" + "\n".join(details) + "\n"
    if failed:
        md += "".join(f"- seed {s} failed: {out / f'seed-{s}' / 'snakemake.log'}\n" for s in failed)
    write_text_atomic(out / "seeds.md", md)
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

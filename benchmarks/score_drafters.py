"""Score the drafters that whole runs of a preset trained on the learning curve's
held-out set (benchmarks/drafter_scaling.py): points of the curve at the presets'
own step counts and data sizes, past its grid, without training anything again.

    python benchmarks/score_drafters.py --heldout results/scaling-bf16 --run A=/tmp/runA/results \
        --run B=/tmp/runB/results [--preset smollm2-135m] [--out results/scaling-bf16/presets.md]

Each run directory is a results_dir of a finished DAG run (<target>/drafters/<method>/
with train_summary.json, <target>/cache/manifest.json for its answer tokens). Every
drafter is measured exactly as the curve's points are (`heldout_acceptance`: c*_k =
Σ_v min(p_d, p_t) at T = 1, every held-out answer position an anchor) and printed in
the curve's table format (`markdown`), its "train CPU-s" the run's training wall time
on one thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_scaling import heldout_acceptance, markdown, summarize  # noqa: E402


def run_points(name: str, results: Path, cfg: dict, target, held) -> list[dict]:
    from deepspec.drafters import load_drafter
    from deepspec.training.run import step_spec

    points = []
    for drafters in sorted(results.glob("*/drafters")):
        manifest = json.loads((drafters.parent / "cache" / "manifest.json").read_text())
        for d in sorted(p for p in drafters.iterdir() if (p / "train_summary.json").exists()):
            summary = json.loads((d / "train_summary.json").read_text())
            drafter = load_drafter(d, target, cfg["drafter"])
            samples = heldout_acceptance(drafter, held, step_spec(cfg))
            points.append({"method": drafter.method, "arm": name, "tokens": int(manifest["num_loss_tokens"]),
                           "actual_tokens": int(manifest["num_loss_tokens"]), "steps": int(summary["steps"]),
                           "arm_steps": int(summary["steps"]), "train_cpu_s": float(summary["elapsed_s"]),
                           "samples": samples})
            print(f"{name}/{drafters.parent.name}/{d.name}: {summary['steps']} steps, "
                  f"held-out c*_1 {sum(cs[0] for _, cs in samples) / len(samples):.3f}", flush=True)
    return points


def main(argv=None) -> int:
    import torch

    from deepspec.config import load_config
    from deepspec.data.datasets import CacheDataset
    from deepspec.files import write_text_atomic
    from deepspec.paths import RunPaths
    from deepspec.targets.loading import target_from_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heldout", type=Path, required=True, help="drafter_scaling.py's --out (its held-out cache)")
    p.add_argument("--run", action="append", required=True, metavar="NAME=RESULTS_DIR")
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--out", type=Path, default=None, help="markdown table (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.preset)
    target = target_from_config(cfg)
    held = CacheDataset(RunPaths.of(load_config(args.preset, {"results_dir": str(args.heldout / "heldout")})).cache_dir())
    points = []
    for spec in args.run:
        name, _, where = spec.partition("=")
        points += run_points(name, Path(where), cfg, target, held)
    table = markdown(summarize(points, float("nan")))
    print(table)
    if args.out:
        write_text_atomic(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

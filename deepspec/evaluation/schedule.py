"""The schedule rule (workflow/rules/evaluate.smk): on DSpark's evaluation
records, the static confidence-threshold sweep (paper Figure 5), Sequential
Temperature Scaling fitted on half the samples (Sec. 3.2.1, Figure 6) and
Algorithm 1 simulated on the other half against the target's measured
steps-per-second curve (Sec. 3.2.2).

Outputs beside the records R/T/eval/<method>/<benchmark>.csv, written atomically:
  <benchmark>.sweep.csv        acceptance and length per threshold
  <benchmark>.calibration.csv  calibration error before and after STS per position
  <benchmark>.alg1.json        STS temperatures, the SPS curve and Algorithm 1 vs a fixed length
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from ..config import add_config_args, config_from_args
from ..errors import DeepSpecError
from ..files import json_safe, require_file, write_csv_atomic, write_json_atomic
from ..paths import RunPaths
from ..settings import Settings

log = logging.getLogger(__name__)


def schedule(s: Settings, method: str, benchmark: str, records: str | None = None, max_batch_tokens: int = 16) -> dict:
    """Sweep, STS and Algorithm 1 on one benchmark's records; returns alg1.json's content."""
    from ..core.acceptance import conf_logits
    from ..core.calibration import apply_sts, split_samples, sts_before_after
    from ..core.decode import profile_target_sps
    from ..core.scheduler import simulate_schedule, threshold_sweep
    from .evaluate import eval_target

    records = Path(records) if records else RunPaths.of(s).records(method, benchmark)
    df = pd.read_csv(require_file(records, "evaluation records"))
    x = conf_logits(df)
    if x.shape[1] == 0 or not np.isfinite(x).any():
        raise DeepSpecError(f"{records}: no confidence logits (schedule needs a drafter with a confidence head)")
    if df["sample_id"].nunique() < 2:
        raise DeepSpecError("calibration needs records from at least 2 samples (raise the benchmark cap)")
    if s.eval.confidence_threshold > 0:
        log.warning("records were made with a confidence threshold: the sweep and Algorithm 1 assume full proposals")
    base = records.with_suffix("")
    write_csv_atomic(threshold_sweep(df, s.ablations.thresholds), base.with_suffix(".sweep.csv"))

    A, L = df["accepted"].to_numpy(), df["proposal_len"].to_numpy()
    fit, held = split_samples(df["sample_id"], s.eval.seed)
    cal, temps = sts_before_after(x, A, L, fit)
    write_csv_atomic(cal, base.with_suffix(".calibration.csv"))

    gamma = x.shape[1]
    sizes = list(range(1, max(max_batch_tokens, gamma + 1) + 1))
    sps = profile_target_sps(eval_target(s), sizes, context_len=min(256, s.data.max_length))
    full = held & (L == gamma) & np.isfinite(x).all(1)  # realised acceptance of full proposals
    c = apply_sts(x[full], temps)
    sims = [{"batch": R, **simulate_schedule(c, A[full], sps, batch=R, seed=s.eval.seed)}
            for R in range(1, max(sizes) // (gamma + 1) + 1) if full.sum() >= R]
    alg1 = {"target": s.target.name, "method": method, "benchmark": benchmark, "gamma": gamma,
            "sts_temperatures": temps.tolist(), "n_rounds_fit": int(fit.sum()), "n_rounds_eval": int(full.sum()),
            "sps": {"batch_tokens": [int(b) for b in sps.batch_tokens], "steps_per_s": sps.steps_per_s.tolist()},
            "simulations": sims}
    write_json_atomic(base.with_suffix(".alg1.json"), json_safe(alg1))
    for sim in sims:
        log.info("Algorithm 1, %d request(s)/step: %.2f vs fixed %.2f tokens/s (x%.3f), mean verify length %.2f",
                 sim["batch"], sim["theta_alg1"], sim["theta_fixed"], sim["speedup_vs_fixed"], sim["mean_verify_len"])
    return alg1


def cli_schedule(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec schedule", description="threshold sweep, STS calibration, Algorithm 1")
    add_config_args(p)
    p.add_argument("--method", default="dspark")
    p.add_argument("--benchmark", required=True)
    p.add_argument("--records", help="records CSV (default R/T/eval/<method>/<benchmark>.csv)")
    p.add_argument("--max-batch-tokens", type=int, default=16, help="SPS profiled for B = 1..this")
    args = p.parse_args(argv)
    schedule(Settings.of(config_from_args(args)), args.method, args.benchmark, args.records, args.max_batch_tokens)
    return 0

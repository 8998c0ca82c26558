"""Cost of one drafter training step (forward + backward) on the preset's cache,
and what the two target-head savings in deepspec/core/train_step.py buy.

The frozen full-vocabulary target head that gives p_t dominates the step of a
small drafter. `block_step` computes p_t once per distinct (sequence,
position) and gathers it for the overlapping blocks, and DFlash (CE-only loss)
skips p_t off log steps. This runs, in one process, the same seeded steps with
p_t computed per block slot (the straightforward way) and with the shipped
code, and prints seconds per step and the ratio.

    python benchmarks/bench_train_step.py [--preset smollm2-135m] [--results DIR] [--steps 6]

Needs the preset's target cache (results/<target>/cache, built by the DAG).
"""
import argparse
import dataclasses
import time

import torch

from deepspec.config import load_config
from deepspec.data.datasets import make_train_dataset, token_counts, train_collate
from deepspec.drafters import build_drafter
from deepspec.targets.loading import target_from_config
from deepspec.training.run import step_spec


def time_steps(drafter, batches, spec, log_step):
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        loss, _ = drafter.training_step(batch, spec, torch.Generator().manual_seed(i), log_step=log_step)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return sum(times[1:]) / (len(times) - 1)  # the first step is warm-up


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--results", default=None, help="results_dir holding <target>/cache")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, {"results_dir": args.results} if args.results else None)
    target = target_from_config(cfg)
    data = make_train_dataset(cfg, target=target)
    counts = token_counts(data, target.vocab_size) if cfg["drafter"].get("draft_vocab_size") else None
    g, n = int(cfg["train"]["global_batch"]), len(data)
    collate = train_collate(data)  # online mode: the target forward of each batch
    batches = [collate([data[(i * g + j) % n] for j in range(g)]) for i in range(args.steps)]
    shipped = step_spec(cfg)
    per_slot = dataclasses.replace(shipped, pt_table_bytes=0)  # no shared table: p_t for every block slot
    for method in ("dflash", "dspark"):
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg, token_counts=counts)
        naive = time_steps(d, batches, per_slot, log_step=True)
        fast = time_steps(d, batches, shipped, log_step=method != "dflash")
        print(f"{method:7s} {cfg['drafter']['num_layers'][method]} layers: p_t per slot {naive:.3f} s/step, "
              f"shipped {fast:.3f} s/step ({'no p_t off log steps' if method == 'dflash' else 'p_t per position'}): "
              f"{naive / fast:.2f}x")


if __name__ == "__main__":
    main()

"""Cost of one drafter training step (forward + backward) on the preset's cache,
and what the target-head savings in deepspec/core/train_step.py buy.

The frozen full-vocabulary target head that gives p_t dominates the step of a
small drafter. `block_step` computes p_t once per distinct (sequence,
position) and gathers it for the overlapping blocks, DFlash (CE-only loss)
skips p_t off log steps, and with the cache's log-normalizers (``target_lse``)
a row of p_t costs the K draft-vocabulary columns of the head instead of all V.
This runs, in one process and under the training's precision (train.precision:
bf16 autocast where the CPU multiplies bf16 natively), the same seeded steps
three ways, interleaved step by step so that the machine's drift hits all
alike, and prints seconds per step and the ratios:

  * per slot: p_t for every block slot from all V logits (the straightforward way);
  * V logits: the shared p_t table, normalised over all V logits (a version-1 cache);
  * shipped: the shared table from the K draft columns and target_lse.

    python benchmarks/bench_train_step.py [--preset smollm2-135m] [--results DIR] [--steps 12]

Needs the preset's target cache (results/<target>/cache, built by the DAG); a
version-1 cache gets its log-normalizers computed here.
"""
import argparse
import dataclasses
import statistics
import time

import torch

from deepspec.config import load_config
from deepspec.data.cache import cache_target
from deepspec.data.datasets import make_train_dataset, token_counts, train_collate
from deepspec.drafters import build_drafter
from deepspec.runtime import resolve_precision
from deepspec.settings import Settings
from deepspec.targets.loading import target_from_config
from deepspec.training.run import step_spec


def one_step(drafter, batch, spec, seed, log_step, bf16):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = drafter.training_step(batch, spec, torch.Generator().manual_seed(seed), log_step=log_step)
    loss.backward()
    drafter.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--results", default=None, help="results_dir holding <target>/cache")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="eagle3,dflash,dspark")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, {"results_dir": args.results} if args.results else None)
    s = Settings.of(cfg)
    bf16 = resolve_precision(s.train.precision, "cpu", stage="train") == "bfloat16"
    target = target_from_config(cfg)
    data = make_train_dataset(cfg, target=target)
    counts = token_counts(data, target.vocab_size) if cfg["drafter"].get("draft_vocab_size") else None
    g, n = int(cfg["train"]["global_batch"]), len(data)
    collate = train_collate(data)  # online mode: the target forward of each batch
    batches = [collate([data[(i * g + j) % n] for j in range(g)]) for i in range(args.steps)]
    if "target_lse" not in batches[0]:  # a version-1 cache: the normalizers as build-cache computes them
        head = cache_target(s, target)
        for b in batches:
            b["target_lse"] = head.log_normalizer(b["last_hidden"]).masked_fill(~b["attention_mask"], 0.0)
    without = [{k: v for k, v in b.items() if k != "target_lse"} for b in batches]
    shipped = step_spec(cfg)
    per_slot = dataclasses.replace(shipped, pt_table_bytes=0)  # no shared table: p_t for every block slot
    print(f"{args.preset}: {args.steps} steps of {g} sequences, {'bf16 autocast' if bf16 else 'fp32'}, "
          f"{args.threads} thread(s), draft vocabulary {cfg['drafter'].get('draft_vocab_size') or 'full'}")
    for method in args.methods.split(","):
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg, token_counts=counts)
        arms = {"per slot": (without, per_slot), "V logits": (without, shipped), "shipped": (batches, shipped)}
        if method == "eagle3":
            del arms["per slot"]  # a chain step has no blocks
        times = {k: [] for k in arms}
        for i in range(args.steps):
            for k, (bs, spec) in arms.items():
                t = one_step(d, bs[i], spec, i, True, bf16)
                if i:  # the first step of each arm is warm-up
                    times[k].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        cols = ", ".join(f"{k} {v:.3f} s" for k, v in med.items())
        ratios = ", ".join(f"{k} / shipped {med[k] / med['shipped']:.2f}x" for k in med if k != "shipped")
        print(f"{method:7s} (log steps, median): {cols}; {ratios}")


if __name__ == "__main__":
    main()

"""Cost of verifying k tokens vs one plain decode step on the target.

Speculative decoding pays off only when tau exceeds the ratio
cost(verify gamma+1 tokens) / cost(decode 1 token) (plus the drafter's cost),
so this ratio sizes what a drafter must reach on the machine it runs on.

    python benchmarks/bench_verify_cost.py [--preset smollm2-135m] [--context 256]

Prints, from one run, the time per forward of k new tokens over a cached
context and its ratio to k = 1.
"""
import argparse
import time

import torch

from deepspec.config import load_config
from deepspec.targets.loading import target_from_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    target = target_from_config(load_config(args.preset))
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, target.vocab_size, (1, args.context), generator=g)
    times = {}
    with torch.no_grad():
        for k in [1, 2, 4, 8, 12, 16]:
            new = torch.randint(0, target.vocab_size, (1, k), generator=g)
            samples = []
            for i in range(args.iters + 1):
                out = target.model(ctx, use_cache=True)
                cache = out.past_key_values
                t0 = time.perf_counter()
                target.model(new, past_key_values=cache, use_cache=True, output_hidden_states=True)
                if i:  # first iteration is warm-up
                    samples.append(time.perf_counter() - t0)
            times[k] = sorted(samples)[len(samples) // 2]
    print(f"target {target.target_id}, context {args.context}, threads {torch.get_num_threads()}")
    print(f"{'k':>4} {'ms/forward':>11} {'ratio to k=1':>13}")
    for k, t in times.items():
        print(f"{k:>4} {1000 * t:>11.1f} {t / times[1]:>13.2f}")
    print(f"break-even tau for gamma=7 (verify 8 tokens, drafter free): {times[8] / times[1]:.2f}")


if __name__ == "__main__":
    main()

"""Speedup of speculative decoding over plain and prompt-lookup decoding,
all measured in ONE process on the same prompts (so the ratios share the same
machine state), with a per-round profile of where the time goes.

    python benchmarks/bench_speedup.py [--preset smollm2-135m] [--benchmark gsm8k] [--n 3] [--max-new 64]

Needs the trained drafters of the preset (results/<target>/drafters/<method>/).
Prints tokens/s for plain, prompt-lookup and each drafter, the ratios, tau,
and the mean draft / verify time per round.
"""
import argparse
import time

import torch

from deepspec.config import load_config, parse_set
from deepspec.core.decode import plain_generate, prompt_lookup_generate, speculative_generate
from deepspec.data.prompts import benchmark_prompt_ids
from deepspec.drafters import load_drafter
from deepspec.evaluation.evaluate import drafter_path
from deepspec.targets.loading import target_from_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--benchmark", default="gsm8k")
    p.add_argument("--n", type=int, default=3, help="prompts")
    p.add_argument("--max-new", type=int, default=64)
    args = p.parse_args()
    cfg = load_config(args.preset, parse_set(args.overrides))
    T, seed = cfg["eval"]["temperature"], cfg["eval"]["seed"]
    target = target_from_config(cfg)
    prompts = benchmark_prompt_ids(cfg, target, args.benchmark)[: args.n]
    gen = lambda i: torch.Generator().manual_seed(seed + i)  # noqa: E731

    def run(name, fn):
        fn(0, prompts[0][1], 4)  # warm-up
        toks, secs, rounds = 0, 0.0, []
        for i, (_, ids) in enumerate(prompts):
            g = fn(i, ids, args.max_new)
            toks, secs, rounds = toks + len(g.tokens), secs + g.time_s, rounds + g.rounds
        return {"name": name, "tps": toks / secs, "rounds": rounds}

    results = [
        run("plain", lambda i, ids, m: plain_generate(target, ids, max_new_tokens=m, temperature=T, generator=gen(i))),
        run("prompt_lookup", lambda i, ids, m: prompt_lookup_generate(
            target, ids, max_new_tokens=m, temperature=T, num_tokens=cfg["eval"]["prompt_lookup_num_tokens"], seed=seed + i)),
    ]
    for method in cfg["train"]["methods"]:
        drafter = load_drafter(drafter_path(cfg, method), target).eval()
        layers = drafter.config.deepspec_feature_layers
        results.append(run(method, lambda i, ids, m, d=drafter: speculative_generate(
            target, d, ids, feature_layers=layers, max_new_tokens=m, temperature=T, generator=gen(i))))
    plain, pld = results[0]["tps"], results[1]["tps"]
    print(f"{cfg['target']['name']} / {args.benchmark}: {len(prompts)} prompts x {args.max_new} new tokens, T={T}, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'method':>14} {'tok/s':>7} {'vs plain':>9} {'vs PLD':>7} {'tau':>5} {'draft ms':>9} {'verify ms':>10}")
    for r in results:
        rr = r["rounds"]
        tau = sum(x["emitted"] for x in rr) / len(rr) if rr else float("nan")
        d = 1000 * sum(x["draft_time_s"] for x in rr) / len(rr) if rr else float("nan")
        v = 1000 * sum(x["verify_time_s"] for x in rr) / len(rr) if rr else float("nan")
        print(f"{r['name']:>14} {r['tps']:>7.2f} {r['tps'] / plain:>8.2f}x {r['tps'] / pld:>6.2f}x {tau:>5.2f} {d:>9.1f} {v:>10.1f}")


if __name__ == "__main__":
    main()

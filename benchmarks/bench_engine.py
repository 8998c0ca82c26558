"""The batched engine (deepspec/core/engine.py) against the batch-1 loop, and live
Algorithm 1 against fixed gamma, static thresholds and plain batched decoding,
all in ONE process so the ratios share the same machine state.

    python benchmarks/bench_engine.py [--preset smollm2-135m] [--set key=value ...] [--method dspark]
        [--drafter DIR] [--n 16] [--max-new 64] [--batch 4,8,16] [--concurrency 1,4,16] [--sts alg1.json]

1. Evaluation throughput: speculative rounds per CPU-second (process time, all
   threads) of `speculative_generate` over n prompts, one at a time, against the
   engine over the same prompts, queued shortest first as `evaluate` queues
   them, at each --batch size (fixed gamma); the share
   of padding in the engine's target forwards; and one padded forward of ragged
   rows against the same rows forwarded one by one (what packing could at best
   approach).
2. Throughput under load at each --concurrency (n requests): tokens/s of plain
   batched decoding, every fixed l = 1..gamma, every static threshold 0.1..0.9
   and live Algorithm 1 (SPS(B) profiled on the engine at that concurrency,
   printed so its shape explains where Algorithm 1 wins or loses), with
   Algorithm 1's ratio to each.

The drafter is --drafter, else the preset's trained one (R/T/drafters/<method>),
else an untrained one built with the preset's settings (said so in the output:
its acceptance and confidences are then meaningless, only the costs are).
"""
import argparse
import time

import torch

from deepspec.config import load_config, parse_set
from deepspec.core.batch_cache import BatchKV
from deepspec.core.decode import speculative_generate
from deepspec.core.engine import BatchedEngine, Request, padding_share, profile_engine_sps
from deepspec.core.policies import FixedGamma, LiveAlgorithm1, PaddedAlgorithm1, StaticThreshold
from deepspec.evaluation.evaluate import drafter_path
from deepspec.evaluation.throughput import load_prompts, run_load
from deepspec.files import read_json
from deepspec.targets.loading import target_from_config


def _drafter(cfg, target, method, path):
    from pathlib import Path

    from deepspec.drafters import build_drafter, load_drafter

    path = path or drafter_path(cfg, method)
    if (Path(path) / "config.json").exists():
        return load_drafter(path, target).eval(), f"trained ({path})"
    torch.manual_seed(0)
    return build_drafter(method, target, cfg).eval(), "UNTRAINED (no checkpoint found; costs only)"


def _cpu(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def part1(cfg, target, drafter, prompts, max_new, batches):
    T, seed, layers = cfg["eval"]["temperature"], cfg["eval"]["seed"], drafter.config.deepspec_feature_layers
    speculative_generate(target, drafter, prompts[0], feature_layers=layers, max_new_tokens=4, temperature=T)  # warm-up
    gens, cpu, wall = _cpu(lambda: [speculative_generate(target, drafter, ids, feature_layers=layers, max_new_tokens=max_new,
                                                         temperature=T, generator=torch.Generator().manual_seed(seed + i))
                                    for i, ids in enumerate(prompts)])
    base = sum(len(g.rounds) for g in gens) / cpu
    print(f"\n1. evaluation throughput ({len(prompts)} prompts x {max_new} new tokens, fixed gamma)")
    print(f"{'decoder':>12} {'rounds':>7} {'CPU s':>7} {'wall s':>7} {'rounds/CPU-s':>13} {'vs loop':>8} {'padding':>8}")
    print(f"{'batch-1 loop':>12} {sum(len(g.rounds) for g in gens):>7} {cpu:>7.1f} {wall:>7.1f} {base:>13.2f} {1:>7.2f}x {'':>8}")
    for b in batches:
        eng = BatchedEngine(target, drafter, feature_layers=layers, temperature=T, max_batch=b)
        reqs = sorted((Request(i, ids, max_new, seed=seed + i) for i, ids in enumerate(prompts)),
                      key=lambda r: len(r.prompt_ids))  # as evaluate queues them (evaluation/evaluate.py:run_batched)
        done, cpu, wall = _cpu(lambda: eng.generate(reqs))
        n = sum(len(f.rounds) for f in done)
        print(f"{'engine ' + str(b):>12} {n:>7} {cpu:>7.1f} {wall:>7.1f} {n / cpu:>13.2f} {n / cpu / base:>7.2f}x "
              f"{padding_share(eng.stats):>7.1%}")


@torch.no_grad()
def padding_vs_rows(target, rows=8, ctx=128, seed=0):
    """One padded forward of ragged verify widths vs the rows forwarded one at a time."""
    from deepspec.core.decode import target_forward
    from deepspec.core.target import crop_cache, new_cache

    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(1, 9, (rows,), generator=g)
    kv, caches = BatchKV(), []
    for _ in range(rows):
        ids = torch.randint(0, target.vocab_size, (1, ctx), generator=g)
        for into in ("batch", "row"):  # BatchKV adopts the first cache it gets: prefill twice
            c = new_cache()
            target_forward(target, ids, c, None, last_only=True)
            kv.add(c, ctx) if into == "batch" else caches.append(c)
    ids = torch.randint(0, target.vocab_size, (rows, int(widths.max())), generator=g)

    def padded():
        kv.forward(target, ids, widths, None)
        kv.commit(ctx, torch.zeros(rows, dtype=torch.long))

    def one_by_one():
        for r in range(rows):
            target_forward(target, ids[r : r + 1, : int(widths[r])], caches[r], None)
            crop_cache(caches[r], ctx)

    for fn in (padded, one_by_one):
        fn()
    tp = min(_cpu(padded)[2] for _ in range(3))
    tr = min(_cpu(one_by_one)[2] for _ in range(3))
    print(f"   ragged verify of {rows} rows, widths {widths.tolist()} after {ctx} tokens: one padded forward "
          f"{tp * 1e3:.0f} ms ({rows * int(widths.max())} tokens) vs row by row {tr * 1e3:.0f} ms "
          f"({int(widths.sum())} tokens): padding {tr / tp:.2f}x faster")


def part2(cfg, target, drafter, prompts, max_new, levels, temps, fixed, thresholds):
    T, seed, layers, g = cfg["eval"]["temperature"], cfg["eval"]["seed"], drafter.config.deepspec_feature_layers, drafter.gamma
    print(f"\n2. throughput under load ({len(prompts)} requests x {max_new} new tokens): tokens/s; alg1 / policy")
    for c in levels:
        sps = profile_engine_sps(target, c, list(range(1, g + 2)), context_len=cfg["throughput"]["sps_context"])
        print(f"\n   concurrency {c}: SPS(B) of the engine: " + ", ".join(
            f"B={int(b)}: {s:.2f}" for b, s in zip(sps.batch_tokens, sps.steps_per_s)))
        pols = {"plain": None, **{f"fixed l={k}": FixedGamma(k) for k in fixed or range(1, g + 1)},
                **{f"threshold {t:.1f}": StaticThreshold(t) for t in thresholds},
                "alg1-padded": PaddedAlgorithm1(sps, temperatures=temps), "alg1": LiveAlgorithm1(sps, temperatures=temps)}
        res = {name: run_load(target, None if pol is None else drafter, prompts, policy=pol or FixedGamma(),
                              concurrency=c, max_new_tokens=max_new, temperature=T, seed=seed, feature_layers=layers)
               for name, pol in pols.items()}
        a = res["alg1"]["tokens_per_s"]
        print(f"   {'policy':>14} {'tok/s':>7} {'per req':>8} {'verify l':>9} {'tau':>5} {'alg1 / it':>10}")
        for name, r in res.items():
            print(f"   {name:>14} {r['tokens_per_s']:>7.2f} {r['per_request_tokens_per_s']:>8.2f} "
                  f"{r['mean_verify_len']:>9.2f} {r['tau']:>5.2f} {a / r['tokens_per_s']:>9.2f}x")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--method", default="dspark")
    p.add_argument("--drafter")
    p.add_argument("--sts", help="a schedule rule's alg1.json: Algorithm 1 uses its STS temperatures")
    p.add_argument("--n", type=int, default=16, help="prompts / requests")
    p.add_argument("--max-new", type=int, help="new tokens per request (default: the preset's eval.max_new_tokens "
                                              "in part 1, throughput.max_new_tokens in part 2)")
    p.add_argument("--batch", default="4,8,16")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--skip", default="", help="parts to skip: 1 and/or 2")
    p.add_argument("--fixed", default="", help="fixed verify lengths l to compare (default 1..gamma)")
    p.add_argument("--thresholds", default="0.1,0.3,0.5,0.7,0.9")
    args = p.parse_args()
    cfg = load_config(args.preset, parse_set(args.overrides))
    torch.set_num_threads(int(cfg["resources"].get("evaluate", {}).get("threads", torch.get_num_threads())))
    target = target_from_config(cfg)
    drafter, how = _drafter(cfg, target, args.method, args.drafter)
    prompts = load_prompts(cfg, target, args.n)
    print(f"{cfg['target']['name']}, {args.method} drafter {how}, T={cfg['eval']['temperature']}, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    if "1" not in args.skip:
        part1(cfg, target, drafter, prompts, args.max_new or cfg["eval"]["max_new_tokens"],
              [int(x) for x in args.batch.split(",")])
        padding_vs_rows(target)
    if "2" not in args.skip:
        temps = read_json(args.sts)["sts_temperatures"] if args.sts else None
        part2(cfg, target, drafter, prompts, args.max_new or cfg["throughput"]["max_new_tokens"],
              [int(x) for x in args.concurrency.split(",")], temps,
              [int(x) for x in args.fixed.split(",") if x], [float(x) for x in args.thresholds.split(",")])


if __name__ == "__main__":
    main()

"""fp32 against bf16 per CPU stage, interleaved in one process: what each
stage's `precision: auto` chooses and why (docs/PERFORMANCE.md).

    python benchmarks/bench_precision.py [--preset smollm2-135m] [--results DIR] [--repeats 3]
        [--stages cache regenerate train engine decode]

Each stage runs the same work in fp32 and in bf16 (the target loaded in that
dtype, or training under torch.autocast('cpu', bfloat16)), the two alternating
`--repeats` times so that drift of a shared machine hits both; it prints the
median seconds of each and the ratio fp32 / bf16 (above 1: bf16 is faster).

- cache: the target's forward with hidden states over cache.batch_size
  training sequences (build_cache's shape), cache.batch_size x 2 threads;
- regenerate: batched sampling of regenerate.batch_size prompts, 32 new tokens,
  1 thread (one shard's job), fp32 on torch's kernels and bf16 on oneDNN-packed
  weights, as the stage decodes;
- train: a DFlash, DSpark and Eagle3 training step (forward + backward) on the
  preset's cache at train.num_anchors and 4x that, 1 thread;
- engine: a round of evaluation's batched engine (eval.batch_size requests, an
  untrained DSpark, fixed 7-token proposals), seconds per round, 1 thread;
- decode: a batch-1 target forward of 1 and of 8 tokens as evaluation's timed decoding makes it
  (`decode.target_forward`: oneDNN-packed weights with target.cpu_matmul onednn), 1 thread.

Needs the preset's target cache (results/<target>/cache, built by the DAG) for train.
"""
import argparse
import dataclasses
import statistics
import time

import torch


def timed(fn, repeats_inner=1):
    t0 = time.perf_counter()
    for _ in range(repeats_inner):
        fn()
    return (time.perf_counter() - t0) / repeats_inner


def pairs(name, f32, b16, repeats):
    a, b = [], []
    for r in range(repeats):
        order = [(a, f32), (b, b16)] if r % 2 == 0 else [(b, b16), (a, f32)]
        for acc, fn in order:
            acc.append(fn())
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name:44s} fp32 {ma * 1e3:9.1f} ms   bf16 {mb * 1e3:9.1f} ms   fp32/bf16 {ma / mb:5.2f}x", flush=True)
    return ma, mb


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--results", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stages", nargs="+", default=["cache", "regenerate", "train", "engine", "decode"])
    args = p.parse_args()

    from deepspec.config import load_config
    from deepspec.runtime import bf16_matmul_support
    from deepspec.targets.loading import target_from_config

    cfg = load_config(args.preset, {"results_dir": args.results} if args.results else None)
    print(f"bf16 matmul support: {bf16_matmul_support('cpu')}; torch {torch.__version__}", flush=True)
    t32 = target_from_config(cfg, dtype="float32")
    t16 = target_from_config(cfg, dtype="bfloat16")
    layers = list(cfg["target"]["feature_layers"])
    g = torch.Generator().manual_seed(0)
    V = t32.vocab_size

    if "cache" in args.stages:
        torch.set_num_threads(2)
        B = int(cfg["cache"]["batch_size"])
        for L in (256, 512):
            ids = torch.randint(0, V, (B, L), generator=g)
            am = torch.ones_like(ids)
            pairs(f"cache forward {B}x{L}, 2 threads", lambda: timed(lambda: t32.features(ids, layers, attention_mask=am)),
                  lambda: timed(lambda: t16.features(ids, layers, attention_mask=am)), args.repeats)

    if "regenerate" in args.stages:
        from deepspec.regeneration.local import sampling_kernels
        from deepspec.regeneration.sampling import Sampling, generate_batch
        from deepspec.settings import Settings

        torch.set_num_threads(1)
        B = int(cfg["regenerate"]["batch_size"])
        regen = dataclasses.replace(Sampling.of(Settings.of(cfg).regenerate), max_new_tokens=32)
        prompts = [torch.randint(0, V, (40 + (i * 7) % 60,), generator=g).tolist() for i in range(B)]

        def gen(t):
            def run():
                gens = [torch.Generator().manual_seed(i) for i in range(B)]
                with sampling_kernels(t):  # as the stage samples: fp32 on torch's kernels, bf16 packed
                    generate_batch(t.model, prompts, gens, regen, eos_ids=[], pad_id=0)
            return lambda: timed(run)

        pairs(f"regenerate {B} prompts x 32 tokens, 1 thread", gen(t32), gen(t16), args.repeats)

    if "train" in args.stages:
        from deepspec.data.datasets import make_train_dataset, token_counts, train_collate
        from deepspec.drafters import build_drafter
        from deepspec.methods import resolve_method
        from deepspec.training.run import step_spec

        torch.set_num_threads(1)
        data = make_train_dataset(cfg, target=t32)
        counts = token_counts(data, V) if cfg["drafter"].get("draft_vocab_size") else None
        gb, n = int(cfg["train"]["global_batch"]), len(data)
        collate = train_collate(data)
        batches = [collate([data[(i * gb + j) % n] for j in range(gb)]) for i in range(3)]
        for method in ("dflash", "dspark", "eagle3"):
            base, mcfg = resolve_method(cfg, method)
            torch.manual_seed(0)
            d = build_drafter(base, t32, mcfg, token_counts=counts)
            spec0 = step_spec(mcfg)
            for na in ((spec0.num_anchors, 4 * spec0.num_anchors) if method != "eagle3" else (spec0.num_anchors,)):
                spec = dataclasses.replace(spec0, num_anchors=na)

                def step(bf16, spec=spec, d=d):
                    def run():
                        t0 = time.perf_counter()
                        for i, b in enumerate(batches):
                            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                                loss, _ = d.training_step(b, spec, torch.Generator().manual_seed(i), log_step=False)
                            loss.backward()
                            d.zero_grad(set_to_none=True)
                        return (time.perf_counter() - t0) / len(batches)
                    return run

                pairs(f"train {method} step, {gb} seq x {na} anchors, 1 thread", step(False), step(True), args.repeats)

    if "engine" in args.stages:
        from deepspec.core.engine import BatchedEngine, Request
        from deepspec.core.policies import FixedGamma
        from deepspec.drafters import build_drafter
        from deepspec.methods import resolve_method

        torch.set_num_threads(1)
        base, mcfg = resolve_method(cfg, "dspark")
        B = int(cfg["eval"]["batch_size"])
        prompts = [torch.randint(0, V, (60 + (i * 11) % 80,), generator=g).tolist() for i in range(B)]

        def engine(t, dtype):
            torch.manual_seed(0)
            d = build_drafter(base, t, mcfg).to(dtype).eval()  # untrained: the costs, not the acceptance

            def run():
                eng = BatchedEngine(t, d, feature_layers=layers, temperature=1.0, policy=FixedGamma(), max_batch=B)
                reqs = [Request(i, p, 32, seed=i) for i, p in enumerate(prompts)]
                t0 = time.perf_counter()
                eng.generate(reqs)
                return (time.perf_counter() - t0) / eng.stats["rounds"]
            return run

        pairs(f"engine round, {B} requests, untrained DSpark, 1 thread", engine(t32, torch.float32),
              engine(t16, torch.bfloat16), args.repeats)

    if "decode" in args.stages:
        from deepspec.core.batch_cache import engine_cache
        from deepspec.core.decode import target_forward
        from deepspec.core.target import crop_cache

        torch.set_num_threads(1)
        ids = torch.randint(0, V, (1, 200), generator=g)
        for k in (1, 8):  # a plain decoding step; a verification of anchor + 7 drafts with features
            def one(t, k=k):
                def run():
                    c = engine_cache()
                    with torch.no_grad():
                        target_forward(t, ids, c, None, last_only=True)

                        def fwd():
                            target_forward(t, ids[:, :k], c, layers if k > 1 else None, last_only=k == 1)
                            crop_cache(c, ids.shape[1])
                        return timed(fwd, 8)
                return run

            pairs(f"decode batch 1, {k} token(s) (evaluation's target_forward, target.cpu_matmul "
                  f"{cfg['target']['cpu_matmul']}), 1 thread", one(t32), one(t16), args.repeats)


if __name__ == "__main__":
    main()

"""The prepared GPU check: correctness on the accelerator, then
costs at the paper's dimensions without weights, compared with `plan`.

    bash benchmarks/device_check.sh OUTDIR               # one CUDA GPU, <= 8 minutes
    bash benchmarks/device_check.sh OUTDIR --cpu --small  # CI: the same code at tiny sizes

Checks, each timed and recorded (a failing check is recorded, the others run):
  bf16_training   every drafter's training step, forward + backward, under bf16
                  autocast: finite loss and gradients, loss within 5 % of fp32
  flex_attention  flex (BlockMask) vs SDPA (dense mask) training attention, where
                  the drafters offer a flex path
  verify_chi2     chi-square of verify_chain's first emitted token against p_t
  greedy_equal    greedy speculative decoding == plain decoding, every drafter
  varying_flex    flex vs SDPA over several (L, anchors) shapes, dynamo graphs compiled
  online_batch    a padded online micro batch: target forward -> DSpark step + backward
  engine_batch32  the batched engine at 32 rows (greedy == plain decoding), rounds/s
  gemma4          the tiny Gemma4 target: greedy == plain for every drafter, an engine run
  gemma4_unified  the same on the tiny gemma4_unified target (gemma-4-12B-it's decoder)
  paper_dims      a random-weight target of the preset's architecture
                  (config/targets/, planning/plan.py): DSpark training step
                  (5 layers, 512 anchors, length 4096, micro batch 1, online
                  features) time and peak memory, Eagle3 step time (TTT 7), the
                  target's SPS(B), plain decode tokens/s at batch 1, the batched
                  engine at 32 rows of 1k-token prompts (rounds/s, peak memory
                  against the KV bound of eval.kv_budget_gb); with --small the
                  tiny Qwen3 target at small sizes instead
  plan            measured step time against plan's FLOPs at the measured rate,
                  and the projected wall time of the preset on 8 such GPUs
Writes OUTDIR/device_check.json and OUTDIR/device_check.md after every check;
checks not started within --budget-s (390 s: the pytest part of device_check.sh
follows, 8 minutes in all) are recorded as skipped. --gemma4-archs names the tiny
Gemma4 architectures checked (default gemma4,gemma4_unified).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspec.config import load_config  # noqa: E402
from deepspec.core.decode import plain_generate, profile_target_sps, speculative_generate  # noqa: E402
from deepspec.core.target import Target, eos_ids_of  # noqa: E402
from deepspec.core.verify import sample, verify_chain  # noqa: E402
from deepspec.drafters import build_drafter  # noqa: E402
from deepspec.files import write_text_atomic  # noqa: E402
from deepspec.training.run import step_spec  # noqa: E402

METHODS = ("eagle3", "dflash", "dspark")


def sync_device(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev, repeats=3):
    fn()  # warm-up
    sync_device(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_device(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def tiny_target(dev, arch="qwen3"):
    from deepspec.targets.tiny import build_tiny

    model = build_tiny(arch).to(dev).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id=f"tiny-{arch}", eos_token_ids=eos_ids_of(model, None))


def tiny_cfg(layers=(0, 1)):
    return load_config("tiny", {"target": {"feature_layers": list(layers)}, "train": {"num_anchors": 8}})


def random_batch(target, layers, batch, length, prompt, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, length), generator=g)
    lm = torch.zeros(batch, length, dtype=torch.bool)
    lm[:, prompt:] = True
    am = torch.ones(batch, length, dtype=torch.bool)
    feats, last = target.features(ids, layers, attention_mask=am)
    dev = target.device
    return dict(input_ids=ids.to(dev), loss_mask=lm.to(dev), attention_mask=am.to(dev), features=feats, last_hidden=last)


# --------------------------------------------------------------------------- checks


def check_bf16_training(dev, small):
    target, cfg = tiny_target(dev), tiny_cfg()
    batch = random_batch(target, cfg["target"]["feature_layers"], 2, 48, 8)
    out = {}
    for method in METHODS:
        losses = {}
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            d = build_drafter(method, target, cfg).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss, _ = d.training_step(batch, step_spec(cfg), torch.Generator(device=dev).manual_seed(0))
            loss.backward()
            grads = [p.grad for p in d.parameters() if p.grad is not None]
            assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads), method
            losses[str(dtype)] = float(loss.detach())
        rel = abs(losses["torch.bfloat16"] - losses["torch.float32"]) / abs(losses["torch.float32"])
        assert rel < 0.05, f"{method}: bf16 loss {rel:.3%} from fp32"
        out[method] = {"loss_fp32": losses["torch.float32"], "loss_bf16": losses["torch.bfloat16"], "rel_diff": rel}
    return out


def check_flex_attention(dev, small):
    """The block drafters' training attention through flex_attention (BlockMask)
    against SDPA with the dense mask: outputs, and on CUDA gradients too (flex
    has no backward on CPU)."""
    from deepspec.core.train_step import sample_anchors

    target, cfg = tiny_target(dev), tiny_cfg()
    batch = random_batch(target, cfg["target"]["feature_layers"], 2, 64, 8)
    anchors, _ = sample_anchors(batch["loss_mask"], batch["attention_mask"], 8, torch.Generator(device=dev).manual_seed(0))
    out = {}
    for method in ("dflash", "dspark"):
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg).to(dev)
        res = {}
        for backend in ("sdpa", "flex"):
            d.attention_backend = backend
            d.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(dev.type == "cuda"):  # flex has no backward on CPU
                h = d(batch["input_ids"], batch["features"], anchors, batch["attention_mask"])
            grads = None
            if dev.type == "cuda":
                h.float().square().mean().backward()
                grads = torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
            res[backend] = (h.detach().float(), grads)
        diff = float((res["flex"][0] - res["sdpa"][0]).abs().max())
        assert diff < 5e-4, f"{method}: flex vs sdpa outputs differ by {diff}"
        out[f"{method}_max_abs_diff"] = diff
        if dev.type == "cuda":
            gdiff = float((res["flex"][1] - res["sdpa"][1]).abs().max() / res["sdpa"][1].abs().max())
            assert gdiff < 1e-2, f"{method}: flex vs sdpa gradients differ by {gdiff} (relative)"
            out[f"{method}_grad_rel_diff"] = gdiff
    return out


def check_verify_chi2(dev, small):
    from scipy import stats

    n, V, g = (20_000 if small else 200_000), 6, 3
    gen = torch.Generator(device=dev).manual_seed(0)
    pt = torch.softmax(torch.randn(g + 1, V, generator=torch.Generator().manual_seed(1)), -1).to(dev)
    pd = torch.softmax(torch.randn(g, V, generator=torch.Generator().manual_seed(2)), -1).to(dev)
    draft = sample(pd.expand(n, g, V), gen)
    res = verify_chain(pt.log().expand(n, g + 1, V), pd.expand(n, g, V), draft, generator=gen)
    first = res.tokens[:, 0]
    counts = torch.bincount(first, minlength=V).cpu().double()
    p = stats.chisquare(counts.numpy(), (pt[0].cpu().double() * n).numpy()).pvalue
    assert p > 1e-4, f"first emitted token does not follow p_t (p = {p:.2g})"
    return {"n": n, "p_value": float(p)}


def check_greedy_equal(dev, small):
    target, cfg = tiny_target(dev), tiny_cfg()
    tokens, rounds = _greedy_equals_plain(target, cfg, dev, 24, "")
    return {m: {"tokens": tokens, "rounds": r} for m, r in rounds.items()}


def _greedy_equals_plain(target, cfg, dev, max_new_tokens, what):
    """Greedy speculative decoding of every drafter equals plain decoding: (tokens, {method: rounds})."""
    prompt = list(range(5, 25))
    plain = plain_generate(target, prompt, max_new_tokens=max_new_tokens, temperature=0.0).tokens
    rounds = {}
    for method in METHODS:
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg).to(dev).eval()
        spec = speculative_generate(target, d, prompt, feature_layers=cfg["target"]["feature_layers"],
                                    max_new_tokens=max_new_tokens, temperature=0.0)
        assert spec.tokens == plain, f"{method}: {what}greedy speculative output differs from plain decoding"
        rounds[method] = len(spec.rounds)
    return len(plain), rounds


def check_varying_flex(dev, small):
    """The block drafters' flex training path over several (L, anchors) shapes, as
    micro batches of real data come (audit R6): outputs against SDPA at each shape,
    and the dynamo graphs compiled on the way (on CUDA flex is compiled; a
    recompile per shape would show here)."""
    from torch._dynamo.utils import counters

    from deepspec.core.train_step import sample_anchors

    target, cfg = tiny_target(dev), tiny_cfg()
    shapes = [(48, 4), (64, 8), (80, 6), (112, 8)] if small else [(256, 16), (384, 24), (512, 32), (640, 20), (1024, 64)]
    d = build_drafter("dspark", target, cfg).to(dev)
    graphs0, out = counters["stats"]["unique_graphs"], {}
    for L, n in shapes:
        batch = random_batch(target, cfg["target"]["feature_layers"], 2, L, 8, seed=L)
        anchors, _ = sample_anchors(batch["loss_mask"], batch["attention_mask"], n,
                                    torch.Generator(device=dev).manual_seed(L))
        res = {}
        for backend in ("sdpa", "flex"):
            d.attention_backend = backend
            with torch.set_grad_enabled(dev.type == "cuda"):  # flex has no backward on CPU
                h = d(batch["input_ids"], batch["features"], anchors, batch["attention_mask"])
                if dev.type == "cuda":
                    h.float().square().mean().backward()
            res[backend] = h.detach().float()
        diff = float((res["flex"] - res["sdpa"]).abs().max())
        assert diff < 5e-4, f"L {L}, {n} anchors: flex vs sdpa outputs differ by {diff}"
        out[f"max_abs_diff_L{L}_n{n}"] = diff
    out["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs0
    out["shapes"] = len(shapes)
    return out


def check_online_batch(dev, small):
    """One online micro batch: the target's forward over a padded batch of two
    sequences of different lengths feeds a DSpark training step, forward and
    backward (what train does with cache.mode online)."""
    target, cfg = tiny_target(dev), tiny_cfg()
    L = 96 if small else 1024
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, L), generator=g)
    am = torch.ones(2, L, dtype=torch.bool)
    am[1, L // 2 + 3:] = False  # the second sequence is shorter: padding
    lm = am.clone()
    lm[:, :8] = False
    feats, last = target.features(ids, cfg["target"]["feature_layers"], attention_mask=am)
    batch = dict(input_ids=ids.to(dev), loss_mask=lm.to(dev), attention_mask=am.to(dev), features=feats, last_hidden=last)
    torch.manual_seed(0)
    d = build_drafter("dspark", target, cfg).to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss, _ = d.training_step(batch, step_spec(cfg), torch.Generator(device=dev).manual_seed(0), log_step=False)
    loss.backward()
    grads = [p.grad for p in d.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(x).all() for x in grads), "non-finite loss or gradient"
    return {"loss": float(loss.detach()), "features_shape": list(feats.shape)}


def _engine_round(target, cfg, dev, rows, n_new, prompt_len=8, check=True):
    """`rows` greedy requests of different prompt lengths (prompt_len + 3 i) through one
    BatchedEngine of `rows` rows (continuous batching, batched verification): with
    `check`, the first and last outputs equal plain greedy decoding; the rounds' time,
    the peak memory and the engine's KV bound per row (eval.kv_budget_gb's arithmetic)."""
    from deepspec.core.engine import BatchedEngine, Request

    torch.manual_seed(0)
    d = build_drafter("dspark", target, cfg).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, target.vocab_size, (prompt_len + 3 * i,), generator=g).tolist() for i in range(rows)]
    eng = BatchedEngine(target, d, feature_layers=cfg["target"]["feature_layers"], temperature=0.0, max_batch=rows)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync_device(dev)
    t0 = time.perf_counter()
    done = {f.request.request_id: f.tokens for f in eng.generate([Request(i, p, n_new) for i, p in enumerate(prompts)])}
    sync_device(dev)
    wall = time.perf_counter() - t0
    for i in (0, rows - 1) if check else ():
        plain = plain_generate(target, prompts[i], max_new_tokens=n_new, temperature=0.0).tokens
        assert done[i] == plain, f"request {i}: batched greedy output differs from plain decoding"
    last = Request(rows - 1, prompts[-1], n_new)
    out = {"rows": rows, "prompt_tokens": [len(prompts[0]), len(prompts[-1])], "rounds": eng.stats["rounds"],
           "max_rows": eng.stats["max_rows"], "wall_s": wall, "rounds_per_s": eng.stats["rounds"] / wall,
           "kv_bytes_per_token": eng.kv_per_token, "kv_bound_gib": rows * eng.row_bytes(last) / 2**30}
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return out


def check_engine_batch32(dev, small):
    """One engine run at R = 32 rows on the tiny Qwen3 target (audit R7/R8)."""
    return _engine_round(tiny_target(dev, "qwen3"), tiny_cfg(), dev, 32, 6 if small else 16)


# The tiny Gemma4 architectures checked, one check each (targets/tiny.py:build_tiny):
# gemma4, and gemma4_unified, the released gemma-4-12B-it's (audit C7; transformers
# releases without it fail that check alone). --gemma4-archs picks others.
GEMMA4_ARCHS = ("gemma4", "gemma4_unified")


def gemma4_target(dev, arch="gemma4"):
    return tiny_target(dev, arch)


def check_gemma4(dev, small, arch="gemma4"):
    """The Gemma4 target (sliding + full attention, the contiguous batch cache): greedy
    speculative decoding equals plain decoding for every drafter, and an engine run."""
    target = gemma4_target(dev, arch)
    cfg = tiny_cfg(layers=(0, 1, 2))  # sliding, full, sliding
    out = {f"{m}_rounds": r for m, r in _greedy_equals_plain(target, cfg, dev, 16, "Gemma4 ")[1].items()}
    out["engine"] = _engine_round(target, cfg, dev, 4 if small else 16, 6 if small else 16)
    return out


def _paper_target(cfg, dev, small):
    if small:
        return tiny_target(dev, "qwen3"), tiny_cfg()
    from transformers import AutoModelForCausalLM

    from deepspec.targets.specs import load_facts, target_config

    facts, _ = load_facts(cfg)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(target_config(facts), dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id=cfg["target"]["spec"],
                  eos_token_ids=eos_ids_of(model, None)), cfg


def check_paper_dims(dev, small, preset):
    cfg = load_config(preset)
    target, cfg = _paper_target(cfg, dev, small)
    length, prompt = (96, 16) if small else (cfg["data"]["max_length"], 512)
    layers = cfg["target"]["feature_layers"]
    spec = step_spec(cfg)
    out = {"target_params": sum(p.numel() for p in target.model.parameters()), "length": length}
    ids = torch.randint(0, target.vocab_size, (1, length))
    for method in ("dspark", "eagle3"):
        torch.manual_seed(0)
        d = build_drafter(method, target, cfg).to(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        def step():  # online mode: the target forward, then the drafter's step and backward
            am = torch.ones_like(ids, dtype=torch.bool)
            feats, last = target.features(ids, layers, attention_mask=am)
            batch = dict(input_ids=ids.to(dev), loss_mask=torch.ones_like(ids, dtype=torch.bool).to(dev),
                         attention_mask=am.to(dev), features=feats, last_hidden=last)
            batch["loss_mask"][:, :prompt] = False
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss, _ = d.training_step(batch, spec, torch.Generator(device=dev).manual_seed(0), log_step=False)
            loss.backward()
            d.zero_grad(set_to_none=True)

        out[f"{method}_step_s"] = _timed(step, dev, repeats=1 if small else 3)
        if dev.type == "cuda":
            out[f"{method}_peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        d = None  # free the drafter before the next method
    sizes = [1, 2, 4, 8] if small else [1, 2, 4, 8, 16, 32, 64, 128]
    sps = profile_target_sps(target, sizes, context_len=min(256, length))
    out["sps"] = dict(zip(map(int, sps.batch_tokens), map(float, sps.steps_per_s)))
    n_new = 16 if small else 64
    gen = plain_generate(target, ids[0, :64].tolist(), max_new_tokens=n_new, temperature=0.0)
    out["decode_tokens_per_s"] = len(gen.tokens) / gen.time_s
    # the engine at 32 rows on this target with a random DSpark (R7's cost per round, R8's memory);
    # random bf16 weights: batched and alone may break argmax ties differently, so no equality check
    out["engine_32_rows"] = _engine_round(target, cfg, dev, 32, 4 if small else 16, prompt_len=16 if small else 1024,
                                          check=False)
    return out


def compare_with_plan(preset, measured, small):
    """plan's FLOPs for the measured DSpark step (same shape, counted on the meta
    device) give the achieved TFLOP/s; with it, the preset's training (plan's
    FLOPs per step, online target forwards included) on 8 such GPUs."""
    from deepspec.planning import plan as P
    from deepspec.targets.specs import load_facts, meta_target

    cfg = load_config(preset)
    facts, _ = load_facts(cfg)
    target = meta_target(cfg, facts)
    layers = cfg["target"]["feature_layers"]
    drafter, mcfg = P.build_meta_drafter("dspark", target, cfg)
    length = cfg["data"]["max_length"]
    batch = P.synthetic_batch(1, length, 512, target.vocab_size, len(layers), target.hidden_size)
    flops = P.measure_step(drafter, target, batch, step_spec(mcfg))["flops"] + P.measure_target_forward(target, batch, layers)
    plan = P.build_plan(cfg, P.hardware(cfg, gpus=8), offline=True, methods=["dspark"])
    m, fwd = plan["training"]["methods"]["dspark"], plan["training"]["target_forward_flops_per_micro_batch"]
    step_flops = m["flops_per_step"] + fwd * int(cfg["train"]["global_batch"]) // int(cfg["train"]["micro_batch"])
    out = {"flops_at_measured_shape": flops, "plan_flops_per_step": step_flops, "plan_total_steps": m["total_steps"],
           "plan_totals": plan["training"]["totals"]}
    if small:  # the measured step was the tiny target's: no rate to project with
        return {**out, "projection": "skipped with --small"}
    rate = flops / measured["dspark_step_s"]
    return {**out, "measured_tflops": rate / 1e12,
            "projected_wall_hours_8_gpus": m["total_steps"] * step_flops / (8 * rate) / 3600}


# --------------------------------------------------------------------------- driver


def run(name, fn, results, deadline=None, save=None):
    """Run one check and record it; past `deadline` (perf_counter) it is recorded as skipped
    instead of run. `save` writes the results so far (a run killed later keeps them)."""
    t0 = time.perf_counter()
    if deadline is not None and t0 > deadline:
        results[name] = {"ok": False, "skipped": True, "error": "skipped: past the time budget (--budget-s)", "seconds": 0}
        print(f"{name}: SKIPPED (time budget)", flush=True)
        if save:
            save()
        return
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as e:  # noqa: BLE001 - a failed check is recorded, the others still run
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED ' + results[name]['error']} "
          f"({results[name]['seconds']} s)", flush=True)
    if save:
        save()


def summary(results) -> str:
    lines = ["# Device check", "", f"- device: {results['device']}", f"- torch {results['torch']}, "
             f"transformers {results['transformers']}", ""]
    for name, r in results["checks"].items():
        state = "ok" if r["ok"] else "SKIPPED" if r.get("skipped") else "FAILED"
        lines.append(f"## {name}: {state} ({r['seconds']} s)")
        lines += [f"- {k}: {v}" for k, v in r.items() if k not in ("ok", "seconds", "traceback")] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (CI)")
    p.add_argument("--small", action="store_true", help="tiny sizes instead of the paper's dimensions")
    p.add_argument("--preset", default="qwen3-4b")
    p.add_argument("--gemma4-archs", default=",".join(GEMMA4_ARCHS),
                   help="comma-separated tiny Gemma4 architectures (build_tiny), one check each")
    p.add_argument("--budget-s", type=float, default=390.0,
                   help="checks not started within this many seconds are recorded as skipped (the pytest part "
                        "of device_check.sh follows: the whole check fits in 8 minutes)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    import transformers

    results = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "small": a.small, "checks": {}}
    checks = results["checks"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        clean = json.loads(json.dumps(results, default=str), parse_constant=lambda c: None)
        write_text_atomic(out / "device_check.json", json.dumps(clean, indent=2) + "\n")
        write_text_atomic(out / "device_check.md", summary(results) + "\n")

    deadline = t_start + a.budget_s
    for name, fn in (("bf16_training", lambda: check_bf16_training(dev, a.small)),
                     ("flex_attention", lambda: check_flex_attention(dev, a.small)),
                     ("verify_chi2", lambda: check_verify_chi2(dev, a.small)),
                     ("greedy_equal", lambda: check_greedy_equal(dev, a.small)),
                     ("varying_flex", lambda: check_varying_flex(dev, a.small)),
                     ("online_batch", lambda: check_online_batch(dev, a.small)),
                     ("engine_batch32", lambda: check_engine_batch32(dev, a.small)),
                     *((arch, lambda arch=arch: check_gemma4(dev, a.small, arch)) for arch in a.gemma4_archs.split(",")),
                     ("paper_dims", lambda: check_paper_dims(dev, a.small, a.preset)),
                     ("plan", lambda: compare_with_plan(a.preset, checks["paper_dims"], a.small))):
        run(name, fn, checks, deadline, save)
    save()
    return 0 if all(r["ok"] for r in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

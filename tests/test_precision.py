"""bf16 where it pays (deepspec/runtime.py:resolve_precision): the choice per
stage, and the bf16 paths against fp32 within stated tolerances.

Tolerances. bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2 %); a
forward through a few layers compounds that to about 1 %: features within 3 %
of fp32 in relative Frobenius norm, a training step's loss within 2 % and its
gradient direction (cosine) above 0.98. The master weights, optimiser and the
losses' softmax stay fp32 (autocast only casts matmul inputs).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepspec import runtime
from deepspec.drafters import build_drafter
from deepspec.runtime import resolve_precision
from deepspec.training.run import step_spec


@pytest.mark.parametrize("supported", [True, False])
def test_auto_follows_the_hardware_and_explicit_values_are_taken(monkeypatch, supported):
    monkeypatch.setattr(runtime, "bf16_matmul_support", lambda device="cpu": (supported, "test"))
    want = "bfloat16" if supported else "float32"
    assert resolve_precision("auto", "cpu", stage="train") == want
    assert resolve_precision("auto", "cpu", stage="build-cache") == want
    # every stage measured faster in bf16 where the CPU multiplies it natively (decoding on oneDNN-packed
    # weights: regeneration and evaluation)
    assert resolve_precision("auto", "cpu", stage="regenerate") == want
    assert resolve_precision("auto", "cpu", stage="evaluate") == want
    assert resolve_precision("auto", "cuda", stage="regenerate") == want
    for explicit in ("float32", "bfloat16"):
        assert resolve_precision(explicit, "cpu", stage="train") == explicit
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        resolve_precision("fp16", "cpu")


@pytest.mark.parametrize("flags, engine", [
    ({"avx2", "fma"}, None),
    ({"avx512f", "avx512bw"}, None),  # AVX-512 without BF16: emulated
    ({"avx512f", "avx512_bf16"}, "AVX512-BF16"),
    ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AMX-BF16"),
])
def test_the_capability_check_reads_the_cpu(monkeypatch, flags, engine):
    """Without torch's probes, the amx_bf16 and avx512_bf16 flags of /proc/cpuinfo decide."""
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: flags)
    ok, why = runtime.bf16_matmul_support("cpu")
    assert ok is (engine is not None)
    assert (f"with {engine}" in why) if engine else ("without AMX-BF16 or AVX512-BF16" in why)


@pytest.mark.parametrize("amx, avx512_bf16, engine", [
    (False, False, None), (False, True, "AVX512-BF16"), (True, True, "AMX-BF16"), (True, False, "AMX-BF16")])
def test_the_capability_check_takes_torchs_probes(monkeypatch, amx, avx512_bf16, engine):
    """torch's probes win over the flags (which are not read when they exist)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: {"amx_bf16", "avx512_bf16"})
    ok, why = runtime.bf16_matmul_support("cpu")
    assert ok is (engine is not None) and (engine is None or f"with {engine}" in why)


@pytest.fixture(scope="module")
def bf16_target(tiny_cfg):
    from deepspec.targets.loading import target_from_config

    return target_from_config(tiny_cfg, dtype="bfloat16")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_bf16_features_are_the_fp32_features_within_tolerance(tiny_target, bf16_target, tiny_cfg):
    """The cache's forward (build_cache's forward_features) in bf16 against fp32."""
    from deepspec.data.cache import forward_features

    rows = [list(range(5, 60)), list(range(100, 130))]
    layers = tiny_cfg["target"]["feature_layers"]
    f32, l32, z32 = forward_features(tiny_target, layers, rows, torch.float32, lse=True)
    f16, l16, z16 = forward_features(bf16_target, layers, rows, torch.float32, lse=True)
    assert _rel(f16, f32) < 0.03 and _rel(l16, l32) < 0.03
    assert _rel(f16, f32) > 0  # it did run in bf16
    assert _rel(z16, z32) < 0.03  # the log-normalizers


@pytest.fixture(scope="module")
def batch(tiny_target, tiny_cfg):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, tiny_target.vocab_size, (2, 40), generator=g)
    am = torch.ones_like(ids, dtype=torch.bool)
    lm = am.clone()
    lm[:, :6] = False
    feats, last = tiny_target.features(ids, tiny_cfg["target"]["feature_layers"], attention_mask=am)
    return dict(input_ids=ids, loss_mask=lm, attention_mask=am, features=feats, last_hidden=last)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_bf16_autocast_training_step_matches_fp32(tiny_target, tiny_cfg, batch, method):
    spec = dataclasses.replace(step_spec(tiny_cfg), num_anchors=8)
    out = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        d = build_drafter(method, tiny_target, tiny_cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, m = d.training_step(batch, spec, torch.Generator().manual_seed(0))
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
        out[bf16] = (float(loss.detach()), grads, m)
        assert all(p.dtype == torch.float32 for p in d.parameters())  # master weights stay fp32
    (l32, g32, m32), (l16, g16, m16) = out[False], out[True]
    assert l16 == pytest.approx(l32, rel=0.02)
    assert float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)) > 0.98
    assert m16["c_star_1"] == pytest.approx(m32["c_star_1"], abs=0.02)
    assert l16 != l32  # autocast did cast


def test_training_records_the_precision_it_ran_in(tmp_path, tiny_cfg, tiny_target):
    """train.precision reaches accelerate (bf16 autocast or none) and train_summary.json."""
    from test_train import cli_argv

    from deepspec.training import run as T

    for setting, want in (("bfloat16", "bf16"), ("float32", "no")):
        out = tmp_path / setting
        assert T.cli_train(cli_argv(out, tiny_cfg, "dflash", f"train.precision={setting}") + ["--max-steps", "2"]) == 0
        summary = json.loads((out / "results" / "tiny" / "drafters" / "dflash" / "train_summary.json").read_text())
        assert summary["precision"]["mixed_precision"] == want
        assert summary["precision"]["param_dtype"] == "float32"


@pytest.mark.parametrize("supported", [True, False])
def test_evaluation_takes_bf16_where_supported_else_eval_dtype(monkeypatch, supported):
    from deepspec.config import load_config
    from deepspec.evaluation.evaluate import eval_dtype

    monkeypatch.setattr(runtime, "bf16_matmul_support", lambda device="cpu": (supported, "test"))
    cpu = load_config("smollm2-135m")
    assert eval_dtype(cpu) == ("bfloat16" if supported else "float32")
    assert eval_dtype(load_config("smollm2-135m", {"eval": {"precision": "float32"}})) == "float32"
    assert eval_dtype(load_config("smollm2-135m", {"eval": {"precision": "bfloat16"}})) == "bfloat16"
    assert eval_dtype(load_config("smollm2-135m", {"eval": {"dtype": "bfloat16"}})) == "bfloat16"


def test_bf16_regeneration_decodes_on_packed_weights_within_tolerance(tmp_path, tiny_cfg, tiny_target, bf16_target):
    """Regeneration's local backend samples from the target in regenerate.precision on oneDNN-packed
    weights (bf16 packed where oneDNN multiplies bf16): its next-token logits within the 3 % of the
    module docstring of fp32's, and every record regenerated."""
    import copy

    from deepspec.core.target import _packable_dtype, prepacked_linears
    from deepspec.data.prompts import Prompt
    from deepspec.regeneration.regenerate import regenerate

    cfg = copy.deepcopy(tiny_cfg)
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["regenerate"].update(max_new_tokens=6, batch_size=2, precision="bfloat16")
    prompts = [Prompt(id=f"t:{i}", turns=[f"Count to {i}."], source="t") for i in range(3)]
    bf16_target.__dict__.pop("_packed_linears", None)
    stats = regenerate(cfg, tmp_path / "conv.jsonl", prompts=prompts, target=bf16_target)
    assert stats["done"] == 3 and stats["new_tokens"] > 0
    packs = bf16_target.__dict__.get("_packed_linears", {})
    assert (len(packs) > 0) == _packable_dtype(torch.bfloat16)  # packed exactly where oneDNN multiplies bf16
    # fp32 samples on torch's own kernels (the default preset's data, unchanged by packing's rounding)
    cfg["regenerate"]["precision"] = "float32"
    tiny_target.__dict__.pop("_packed_linears", None)
    regenerate(cfg, tmp_path / "conv32.jsonl", prompts=prompts, target=tiny_target)
    assert not tiny_target.__dict__.get("_packed_linears")

    ids = torch.tensor([bf16_target.chat_ids([{"role": "user", "content": "Count to 5."}])])
    with torch.no_grad():
        l32 = tiny_target.model(input_ids=ids).logits[0, -1]
        with prepacked_linears(bf16_target):
            l16 = bf16_target.model(input_ids=ids).logits[0, -1]
    assert l16.dtype == torch.bfloat16 and 0 < _rel(l16, l32) < 0.03

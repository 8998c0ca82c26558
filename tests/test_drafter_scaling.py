"""The learning-curve benchmark's data selection (benchmarks/drafter_scaling.py):
nested token budgets, and held-out prompts that the preset never evaluates."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deepspec.config import load_config
from deepspec.data.prompts import data_root, read_turns_jsonl, subsample

SPEC = importlib.util.spec_from_file_location("drafter_scaling", Path(__file__).parents[1] / "benchmarks" / "drafter_scaling.py")
S = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(S)


def test_budgets_are_nested_prefixes_of_one_order():
    tokens = np.random.default_rng(1).integers(20, 130, 200)
    subsets = S.nested_subsets(tokens, [500, 3000, 10000, 10**9], seed=0)
    small, mid, big, everything = (set(subsets[b]) for b in (500, 3000, 10000, 10**9))
    assert small < mid < big < everything and len(everything) == 200
    for b, idx in ((500, small), (3000, mid), (10000, big)):
        held = tokens[sorted(idx)].sum()
        assert held >= b and held - max(tokens) < b  # the shortest prefix that holds the budget


def test_heldout_prompts_exclude_the_presets_evaluation_prompts(shared_data):
    cfg = load_config("smollm2-135m")
    held = S.heldout_prompts(cfg, per_domain=40, seed=0)
    assert {d: len(v) for d, v in held.items()} == {"Math": 40, "Code": 40, "Chat": 40}
    evaluated = set()
    for b in cfg["data"]["benchmarks"].values():
        evaluated |= {p.turns[0] for p in subsample(read_turns_jsonl(data_root(cfg) / b["path"]), b.get("cap"), cfg["data"]["seed"])}
    picked = [r["turns"][0] for rows in held.values() for r in rows]
    assert len(set(picked)) == len(picked) and not set(picked) & evaluated
    assert S.heldout_prompts(cfg, per_domain=40, seed=0) == held  # seeded


def _point(arch, samples):
    return {"method": "dspark", "tokens": 30000, "steps": 900, "arm": arch, "actual_tokens": 30000,
            "train_cpu_s": 1.0, "samples": samples}


def test_layer_arch_ab_is_paired_over_the_same_samples():
    """paired(): each arm minus the first on the same held-out samples; a uniform
    shift is recovered exactly, with a degenerate interval; noise independent of the
    arm gives an interval that contains 0; different samples are refused."""
    rng = np.random.default_rng(0)
    base = [(d, list(rng.uniform(0.0, 0.5, 7))) for d in S.DOMAINS for _ in range(30)]
    shifted = [(d, [c + 0.04 for c in cs]) for d, cs in base]
    df = S.paired([_point("target", base), _point("qwen3", shifted)])
    pos = df[df.position.astype(str) != "tau"]
    assert set(pos.arm) == {"qwen3"} and set(pos.baseline) == {"target"} and len(pos) == 3 * 7
    assert np.allclose(pos["diff"], 0.04) and np.allclose(pos.ci_low, 0.04) and np.allclose(pos.ci_high, 0.04)
    macro = df[df.domain == "macro"].iloc[0]
    assert macro["diff"] > 0 and macro.ci_low > 0
    noisy = [(d, list(np.clip(np.array(cs) + rng.normal(0, 0.05, 7), 0, 1))) for d, cs in base]
    df = S.paired([_point("target", base), _point("qwen3", noisy)])
    p1 = df[df.position.astype(str) == "1"]
    assert ((p1.ci_low < p1["diff"]) & (p1["diff"] < p1.ci_high)).all()
    assert (p1.ci_low < 0.02).all() and (p1.ci_high > -0.02).all()
    table = S.paired_markdown(df)
    assert "| dspark | 900 | qwen3 − target |" in table and table.count("\n") == 3
    with pytest.raises(SystemExit, match="different held-out samples"):
        S.paired([_point("target", base), _point("qwen3", base[1:] + base[:1])])


def test_arms_are_names_with_preset_overrides_and_a_step_scale():
    """--arm NAME KEY=VALUE ...: overrides parsed as --set, steps=F scales the
    point's steps; --layer-archs is two drafter.layer_arch arms; a name that
    looks like an override, or a repeated one, is refused."""
    arms = S.parse_arms([["base"], ["a64", "train.num_anchors=64", "train.lr=1.2e-3", "steps=0.5"]], None)
    assert arms == {"base": ({}, 1.0), "a64": ({"train": {"num_anchors": 64, "lr": 1.2e-3}}, 0.5)}
    assert S.parse_arms(None, ["target", "qwen3"]) == {
        "target": ({"drafter": {"layer_arch": "target"}}, 1.0), "qwen3": ({"drafter": {"layer_arch": "qwen3"}}, 1.0)}
    assert S.parse_arms(None, None) == {None: ({}, 1.0)}
    for bad in ([["train.lr=1"]], [["x"], ["x", "train.lr=1"]]):
        with pytest.raises(SystemExit, match="new name"):
            S.parse_arms(bad, None)


def test_the_grids_own_axes_are_contrasted_against_their_smallest_value():
    """paired(along="tokens" / "steps"): each budget (step count) minus each smaller
    one at the other axes held fixed, whatever order the points come in; a point with no
    partner along the axis contributes no row."""
    rng = np.random.default_rng(1)
    base = [(d, list(rng.uniform(0.0, 0.5, 7))) for d in S.DOMAINS for _ in range(20)]

    def pt(tokens, steps, shift, method="dflash"):
        return {"method": method, "tokens": tokens, "steps": steps, "arm": None, "actual_tokens": tokens,
                "train_cpu_s": 1.0, "samples": [(d, [c + shift for c in cs]) for d, cs in base]}

    points = [pt(300000, 2700, 0.05), pt(30000, 2700, 0.0), pt(100000, 2700, 0.02), pt(30000, 900, -0.03),
              pt(30000, 300, 0.0, method="eagle3")]
    tok = S.paired(points, "tokens")
    p = tok[tok.position.astype(str) != "tau"]
    assert set(zip(p.tokens, p.baseline)) == {(300000, 30000), (100000, 30000), (300000, 100000)} and set(p.steps) == {2700}
    assert np.allclose(p[(p.tokens == 300000) & (p.baseline == 30000)]["diff"], 0.05)
    assert np.allclose(p[p.tokens == 100000]["diff"], 0.02)
    assert np.allclose(p[(p.tokens == 300000) & (p.baseline == 100000)]["diff"], 0.03)
    steps = S.paired(points, "steps")
    assert set(zip(steps.steps, steps.baseline)) == {(2700, 900)}
    assert np.allclose(steps[steps.position.astype(str) == "1"]["diff"], 0.03)
    table = S.paired_markdown(tok)
    assert "| dflash | 2700 steps | 300k − 30k tokens |" in table and "| dflash | 2700 steps | 100k − 30k tokens |" in table
    assert "| dflash | 2700 steps | 300k − 100k tokens |" in table
    assert "| dflash | 30k tokens | 2700 − 900 steps |" in S.paired_markdown(steps)

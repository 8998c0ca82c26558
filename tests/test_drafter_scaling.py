"""The learning-curve benchmark's data selection (benchmarks/drafter_scaling.py):
nested token budgets, and held-out prompts that the preset never evaluates."""
import importlib.util
from pathlib import Path

import numpy as np

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

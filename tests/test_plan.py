"""`python -m deepspec plan`: cache bytes, FLOPs measured on the meta device,
the shadowed data-dependent ops, offline planning of every preset."""
import dataclasses
import json
import logging
import re
import socket

import pytest
import torch

from deepspec.config import PRESETS_DIR, load_config
from deepspec.planning import plan as P
from deepspec.planning.meta import MetaShadow, build_meta_drafter, measure, param_counts
from deepspec.settings import Settings
from deepspec.targets import specs as S
from deepspec.targets.tiny import tiny_config

PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
PAPER = ["qwen3-4b", "qwen3-8b", "qwen3-14b", "gemma4-12b"]


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails; the hub counts as offline."""
    def refuse(*a, **k):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_cache_bytes_per_token_qwen3_4b_by_hand():
    """Offline cache of Qwen3-4B in bf16: 5 feature layers + the final hidden
    state = 6 x 2560 values x 2 bytes = 30,720 bytes of hidden states per token
    (the hand computation); our cache also stores the token id (int32, 4 bytes)
    and the loss mask (uint8, 1 byte), so a token takes 30,725 bytes in all (a
    full draft vocabulary: no log-normalizers)."""
    cfg = load_config("qwen3-4b", {})
    facts, _ = S.load_facts(cfg)
    target = S.meta_target(cfg, facts)
    data = {"tokens": 1000}
    c = P.cache_section(Settings.of(cfg), target, data, online_flops_per_step=0)
    assert c["hidden_bytes_per_token"] == 6 * 2560 * 2 == 30720
    assert c["bytes_per_token"] == 6 * 2560 * 2 + 4 + 1 and not c["target_lse"]
    assert c["offline_total_bytes"] == 1000 * (6 * 2560 * 2 + 4 + 1)


def test_meta_flops_match_6NT_plus_attention_on_a_tiny_model():
    """A training step (forward + backward) of a tiny Qwen3 LM measured on meta
    agrees within 10 % with 6 N T (N: parameters of every matmul, i.e. all but the
    embedding lookup and the norms; T = B x L tokens) plus attention: QK^T and AV,
    4 B L^2 (H hd) per layer forward, twice that backward."""
    from transformers import Qwen3ForCausalLM

    c = tiny_config("qwen3")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(c)
    B, L = 2, 128
    ids = torch.randint(0, c.vocab_size, (B, L)).to("meta")
    r = measure(lambda: model(input_ids=ids, labels=ids).loss)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name and "norm" not in name)
    attention = 3 * 4 * B * L * L * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    formula = 6 * n * B * L + attention
    assert attention > 0.2 * formula  # the attention term matters at this size
    assert abs(r["flops"] - formula) / formula < 0.10, (r["flops"], formula)
    assert r["flops_forward"] < r["flops"]


def test_shadows_answer_data_dependent_ops_on_meta():
    """.item(), boolean indexing and unique on meta tensors derived from CPU data."""
    with MetaShadow() as sh:
        mask = torch.tensor([True, False, True, True]).to("meta")
        x = torch.empty(4, 3, device="meta")
        assert int(mask.sum()) == 3
        assert x[mask].shape == (3, 3)
        ids = torch.tensor([5, 1, 5, 2]).to("meta")
        u, inv = torch.unique(ids, return_inverse=True)
        assert u.shape == (3,) and u.is_meta and inv.shape == (4,)
        assert bool((ids > 4).any())
        assert float(x.sum()) == 0.0 and sh.unknown_scalars == 1  # a weight-like float: no value


def test_compare_facts_names_the_differing_fields():
    shipped = {"hidden_size": 2560, "text_config": {"num_hidden_layers": 48}, S.SOURCE_KEY: "x", "rms_norm_eps": 1e-6}
    real = {"hidden_size": 4096, "text_config": {"num_hidden_layers": 48}, "rms_norm_eps": 1.0e-06}
    assert S.compare_facts(shipped, real) == ["hidden_size: shipped 2560, hub 4096"]


def test_hub_check_is_skipped_offline_with_one_line(no_network, caplog):
    with caplog.at_level(logging.INFO, logger="deepspec.targets"):
        out = S.check_against_hub({"hidden_size": 1}, "Qwen/Qwen3-4B")
    assert out == {"checked": False, "reason": "offline"}
    assert len([r for r in caplog.records if "not checked" in r.getMessage()]) == 1


@pytest.mark.parametrize("name", PAPER)
def test_paper_targets_have_architecture_facts_that_build(name):
    cfg = load_config(name, {})
    facts, where = S.load_facts(cfg)
    assert where == f"config/targets/{name}.json" and facts[S.SOURCE_KEY]
    target = S.meta_target(cfg, facts)
    target.check_feature_layers(cfg["target"]["feature_layers"])
    assert cfg["cache"]["mode"] == "online"
    expected = {"qwen3-4b": (36, 2560, 151936), "qwen3-8b": (36, 4096, 151936),
                "qwen3-14b": (40, 5120, 151936), "gemma4-12b": (48, 3840, 262144)}[name]
    assert (target.num_layers, target.hidden_size, target.vocab_size) == expected


@pytest.mark.parametrize("name", PRESETS)
def test_plan_runs_offline_for_every_preset(name, no_network, tmp_path, capsys, shared_data, monkeypatch):
    """Every preset is planned with no network; plan.json holds every section.
    The larger paper targets plan DSpark only here (each method costs ~1 s of
    meta execution at paper size); qwen3-4b plans all three."""
    monkeypatch.setenv("DEEPSPEC_DATA", str(shared_data))
    out = tmp_path / f"{name}.json"
    few = ["--methods", "dspark"] if name in PAPER and name != "qwen3-4b" else []
    assert P.cli_plan(["--preset", name, "--out", str(out), *few]) == 0
    plan = json.loads(out.read_text())
    assert set(plan) >= {"data", "cache", "drafters", "training", "evaluation"}
    assert len(plan["training"]["methods"]) == (1 if few else len(load_config(name, {})["train"]["methods"]))
    for method, r in plan["training"]["methods"].items():
        assert r["flops_per_step"] > 0 and r["total_steps"] >= 1, method
        assert r["activation_memory_at_max_length"]["peak_activation_bytes"] > 0
        assert plan["drafters"][method]["trainable"] > 0
        assert plan["evaluation"]["methods"][method]["rounds"] > 0
    assert plan["target"]["hub_check"]["checked"] is False
    assert plan["cache"]["offline_total_bytes"] == plan["cache"]["bytes_per_token"] * plan["data"]["tokens"]
    printed = capsys.readouterr().out
    assert "FLOPs per step" in printed and "offline total" in printed
    # what evaluate and the baselines time plainly, from the preset (not a fixed count)
    cfg = load_config(name, {})
    timed = plan["evaluation"]["plain_decoding"]["timed_prompts"]
    assert set(timed) == set(cfg["eval"]["speed_benchmarks"] or cfg["data"]["benchmarks"])
    assert all(n == min(cfg["eval"]["speed_prompts"], plan["evaluation"]["benchmarks"][b]["prompts"])
               for b, n in timed.items())
    assert ", ".join(f"{n} of {b}" for b, n in timed.items() if n) in printed


def test_plan_json_goes_to_runpaths(no_network, tmp_path, monkeypatch, shared_data):
    from deepspec.paths import RunPaths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEEPSPEC_DATA", str(shared_data))
    cfg = load_config("tiny", {})
    assert P.cli_plan(["--preset", "tiny", "--methods", "dflash", "--gpus", "2", "--mfu", "0.5"]) == 0
    plan = json.loads(RunPaths.of(cfg).plan().read_text())
    assert plan["hardware"]["gpus"] == 2 and plan["hardware"]["mfu"] == 0.5
    assert list(plan["training"]["methods"]) == ["dflash"]
    tot = plan["training"]["totals"]["dflash"]
    want = plan["training"]["methods"]["dflash"]["flops_per_step"] * plan["training"]["methods"]["dflash"]["total_steps"]
    assert tot["total_flops_offline"] == want
    assert tot["gpu_hours_offline"] == pytest.approx(want / (plan["hardware"]["gpu_tflops"] * 1e12 * 0.5) / 3600)


@pytest.mark.parametrize("flag,value,want", [
    ("--gpus", "0", "positive whole number"), ("--gpus", "-2", "positive whole number"),
    ("--mfu", "0", r"in \(0, 1\]"), ("--mfu", "-0.5", r"in \(0, 1\]"), ("--mfu", "5", r"in \(0, 1\]"),
    ("--mfu", "nan", r"in \(0, 1\]"), ("--gpu-tflops", "-1", "positive number"), ("--gpu-tflops", "inf", "positive"),
    ("--gpu-tflops", "0", "positive number"), ("--eval-rounds-per-s", "0", "positive number"),
])
def test_plan_refuses_absurd_hardware_in_one_line(flag, value, want, no_network, tmp_path, capsys, shared_data,
                                                  monkeypatch):
    """Zeros divided by zero, negative MFU gave negative GPU-hours, MFU 5 was taken."""
    from deepspec.cli import main as cli_main

    monkeypatch.setenv("DEEPSPEC_DATA", str(shared_data))
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--preset", "tiny", "--methods", "dflash", "--out", str(out), flag, value])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"deepspec plan: error: {flag} ") and re.search(want, err[0])
    assert not out.exists() and not list(tmp_path.iterdir())
    P.hardware(load_config("tiny", {}), mfu=1.0)  # the bounds themselves are fine
def test_training_memory_per_gpu_by_hand():
    """Qwen3-14B-sized DSpark on 8 GPUs: 14.8 G bf16 target params, 1.86 G trainable
    fp32 drafter params; sharding the optimizer divides only the AdamW moments."""
    cfg = load_config("qwen3-14b", {})
    params = {"trainable": 1_860_000_000, "frozen_own": 10_000_000, "frozen_shared_target": 0}
    cfg["train"]["shard_optimizer"] = False
    m = P.training_memory(cfg, 14_800_000_000, params, 9 * 2**30)
    assert m["target_weights"] == 2 * 14_800_000_000 and m["drafter_weights"] == 4 * 1_870_000_000
    assert m["gradients"] == 4 * 1_860_000_000 and m["adam_moments"] == 8 * 1_860_000_000
    assert m["total"] == 29_600_000_000 + 7_480_000_000 + 7_440_000_000 + 14_880_000_000 + 9 * 2**30
    cfg["train"]["shard_optimizer"] = True
    s = P.training_memory(cfg, 14_800_000_000, params, 9 * 2**30)
    assert s["optimizer_shards"] == 8 and s["adam_moments"] == 1_860_000_000
    assert m["total"] - s["total"] == 7 * 1_860_000_000
    assert load_config("qwen3-14b", {})["train"]["shard_optimizer"]  # the 14B preset shards (80 GB GPUs)


def test_meta_target_eos_ids_are_normalised_as_a_loaded_targets():
    """One EOS normalisation (core.target.eos_ids): sorted, unique, an id or a list or None."""
    from deepspec.core.target import eos_ids

    assert eos_ids(None) == () and eos_ids(7) == (7,) and eos_ids([106, 1, 106]) == (1, 106)
    cfg = load_config("qwen3-4b", {})
    facts, _ = S.load_facts(cfg)
    target = S.meta_target(cfg, dict(facts, eos_token_id=[151645, 151643, 151645]))
    assert target.eos_token_ids == (151643, 151645)


def test_checkpoint_disk_is_one_checkpoint_times_the_number_kept():
    """Qwen3-14B-sized DSpark (1.86 G trainable fp32 parameters): one checkpoint is
    the fp32 drafter plus AdamW's two fp32 moments, 12 B per trainable parameter,
    ~22 GB; the paper presets keep 2 regular checkpoints and the newest hourly
    one, not the ~137 hourly ones of a 14B run (6.6 TB)."""
    t = Settings.of(load_config("qwen3-14b", {})).train
    assert t.keep_checkpoints == 2 and t.checkpoint_minutes == 60

    class Drafter:  # the state dict of a 1.86 G-parameter drafter (bf16 on meta, as plan builds it) + an int64 map
        def state_dict(self):
            return {"w": torch.empty(1_860_000_000, dtype=torch.bfloat16, device="meta"),
                    "d2t": torch.empty(151_936, dtype=torch.int64, device="meta")}

    c = P.checkpoint_disk(t, Drafter(), 1_860_000_000, total_steps=24_120)
    each = 4 * 1_860_000_000 + 8 * 151_936 + 8 * 1_860_000_000
    assert c["bytes_each"] == each and c["regular_checkpoints"] == 9  # 8 x 3000 steps, and the last one
    assert (c["kept_regular"], c["kept_timed"], c["kept"]) == (2, 1, 3)
    assert c["bytes_kept"] == 3 * each and c["bytes_peak"] == 4 * each
    every = P.checkpoint_disk(dataclasses.replace(t, keep_checkpoints=None, checkpoint_minutes=None), Drafter(),
                              1_860_000_000, 24_120)
    assert every["kept"] == 9 and every["bytes_kept"] == 9 * each


def test_plan_predicts_the_checkpoint_a_training_run_writes(tmp_path, tiny_cfg, tiny_target, monkeypatch, shared_data,
                                                            capsys):
    """`plan`'s size of one checkpoint is what `train` writes (within 2 %: RNG
    states, scheduler, log and serialisation headers are not counted), and it
    prints the disk the kept checkpoints take."""
    from deepspec.config import parse_set
    from deepspec.training import run as T

    from helpers import write_conversations

    monkeypatch.setattr("deepspec.targets.loading.target_from_config", lambda cfg, **k: tiny_target)
    write_conversations(tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl")
    sets = [f"resources_dir={tiny_cfg['resources_dir']}", f"data.root={tiny_cfg['data']['root']}",
            f"results_dir={tmp_path / 'results'}", "cache.mode=online", "train.global_batch=2", "train.max_steps=1"]
    assert T.cli_train(["--preset", "tiny", "--method", "dspark", *[x for kv in sets for x in ("--set", kv)]]) == 0
    ckpt = tmp_path / "results" / "tiny" / "drafters" / "dspark" / "checkpoints" / "step_1"
    written = sum(f.stat().st_size for f in ckpt.iterdir())
    cfg = load_config("tiny", parse_set(sets + ["plan.train_prompts=8"]))
    plan = P.build_plan(cfg, P.hardware(cfg), offline=True, methods=["dspark"])
    c = plan["training"]["methods"]["dspark"]["checkpoints"]
    assert abs(c["bytes_each"] - written) <= 0.02 * written, (c, written)
    assert c["kept"] == 1 and c["bytes_kept"] == c["bytes_each"]
    assert "dspark: checkpoints on disk" in P.format_plan(plan)


def test_kv_bytes_per_token_by_hand():
    """layers x K/V heads x head_dim x 2 (keys, values) x dtype bytes; Gemma4's
    full-attention layers with their own heads and width."""
    kv = {n: P.kv_bytes_per_token(S.load_facts(load_config(n, {}))[0], "bfloat16") for n in PAPER}
    assert kv["qwen3-4b"] == kv["qwen3-8b"] == 36 * 8 * 128 * 2 * 2 == 147_456
    assert kv["qwen3-14b"] == 40 * 8 * 128 * 2 * 2 == 163_840
    assert kv["gemma4-12b"] == (40 * 8 * 256 + 8 * 1 * 512) * 2 * 2 == 344_064
    assert P.kv_bytes_per_token(S.load_facts(load_config("qwen3-4b", {}))[0], "float32") == 2 * 147_456


@pytest.mark.parametrize("name", PAPER)
def test_paper_presets_kv_budget_fits_their_gpu(name):
    """Every paper preset sets eval.kv_budget_gb (without it 32 rows padded to the
    longest request need 113-263 GiB of KV cache): the target's and the largest
    drafter's (DSpark's) weights at eval.dtype, the budget and the reserve fit in
    plan.gpu_memory_gib, and the budget holds at least one row of the longest
    request (prompt data.max_prompt_tokens + eval.max_new_tokens)."""
    cfg = load_config(name, {})
    assert cfg["eval"]["kv_budget_gb"] is not None and cfg["eval"]["dtype"] == "bfloat16"
    facts, _ = S.load_facts(cfg)
    target = S.meta_target(cfg, facts)
    drafter, _ = build_meta_drafter("dspark", target, cfg)
    own = param_counts(drafter, target)
    s = Settings.of(cfg)
    m = P.eval_memory(s, sum(p.numel() for p in target.model.parameters()), own["trainable"] + own["frozen_own"],
                      P.kv_bytes_per_token(facts, cfg["eval"]["dtype"]), drafter.kv_bytes_per_token(torch.bfloat16))
    assert m["fits"] and m["total"] <= cfg["plan"]["gpu_memory_gib"] <= 80, m
    assert m["kv_cache"] >= m["longest_row_gib"], m
    # P4: the drafter's own context K/V (5 draft layers, the target's KV geometry) counts too
    if name != "gemma4-12b":
        assert m["drafter_kv_bytes_per_token"] == 5 * m["kv_bytes_per_token"] // target.num_layers
    unbounded = P.eval_memory(dataclasses.replace(s, eval=dataclasses.replace(s.eval, kv_budget_gb=None)), 0, 0,
                              m["kv_bytes_per_token"])
    assert unbounded["kv_cache"] > cfg["plan"]["gpu_memory_gib"]  # what NR9 was: 32 longest rows do not fit


def test_evaluation_and_regeneration_time_scale_with_the_target():
    """P7: a batch-1 round reads the target's weights (bandwidth) and pays a per-layer
    overhead, so 14B's rounds are slower than 4B's; regeneration is compute-bound at full
    concurrency (GPUs x peak x plan.regenerate_mfu / 2 params) and is set against the server
    job's runtime; plan.eval_rounds_per_s still overrides the model; CPU presets regenerate
    locally (measured in docs/RESULTS.md, not estimated)."""
    hw = P.hardware(load_config("qwen3-4b", {}))
    assert hw["eval_rounds_per_s"] is None
    assert P.forward_seconds(8e9, 36, hw) == pytest.approx(8e9 / (3350e9 * 0.6) + 36 * 0.8e-3)
    fake = {"params": {"trainable": 10**8, "frozen_own": 0}, "draft_layers": {"count": 1}, "gamma": 7, "markov_rank": 0}
    small = P.round_rates(Settings.of(load_config("qwen3-4b", {})).eval, 4 * 10**9, 36, {"eagle3": fake}, hw)
    large = P.round_rates(Settings.of(load_config("qwen3-14b", {})).eval, 14 * 10**9, 40, {"eagle3": fake}, hw)
    assert small["methods"]["eagle3"] > large["methods"]["eagle3"] and small["plain"] > large["plain"]
    assert small["plain"] > small["methods"]["eagle3"]  # the drafter's forwards cost something
    fixed = P.round_rates(Settings.of(load_config("qwen3-4b", {})).eval, 4 * 10**9, 36, {"eagle3": fake}, dict(hw, eval_rounds_per_s=30.0))
    assert fixed["methods"] == {"eagle3": 30.0} and fixed["from"] == "plan.eval_rounds_per_s"
    s = Settings.of(load_config("qwen3-14b", {}))
    data = {"regenerated_tokens": 10**9, "regenerated_tokens_upper_bound": 5 * 10**9}
    r14, r4 = P.regeneration_section(s, data, 14 * 10**9, hw), P.regeneration_section(s, data, 4 * 10**9, hw)
    assert r14["estimated"] and r14["hours"] == pytest.approx(3.5 * r4["hours"])
    assert r14["tokens_per_s"] == pytest.approx(8 * 989e12 * 0.2 / 28e9) and r14["runtime_hours"] == 24.0
    assert not P.regeneration_section(Settings.of(load_config("smollm2-135m", {})), data, 10**8, hw)["estimated"]

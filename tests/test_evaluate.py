"""The evaluate / baseline / schedule CLIs end to end on the tiny target (in-process),
with an untrained DSpark drafter saved where the DAG's train rule puts it."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from deepspec.cli import main
from deepspec.config import load_config
from deepspec.errors import DeepSpecError
from deepspec.evaluation import evaluate as E
from deepspec.evaluation.baseline import cli_baseline
from deepspec.evaluation.evaluate import cli_evaluate
from deepspec.evaluation.schedule import cli_schedule

N_PROMPTS = 4
SPEED = 1  # eval.speed_prompts of the tiny preset


pytestmark = pytest.mark.usefixtures("one_thread")  # timing-sensitive decoding: one torch thread


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_cfg, tiny_target):
    from deepspec import drafters

    results = tmp_path_factory.mktemp("results")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        drafters.build_drafter("dspark", tiny_target, tiny_cfg).save_pretrained(results / "tiny/drafters/dspark")
    args = ["--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
            "--set", f"data.root={tiny_cfg['data']['root']}", "--set", f"results_dir={results}",
            "--set", f"data.benchmarks.gsm8k.cap={N_PROMPTS}", "--set", "eval.max_new_tokens=12",
            "--set", "eval.n_boot=20"]
    return results / "tiny" / "eval", args


def test_baseline_evaluate_schedule(setup, shared_data, tiny_target):
    ev, args = setup
    with pytest.raises(DeepSpecError, match="--benchmark nope: not a timed benchmark of this preset"):
        cli_baseline(args + ["--benchmark", "nope"])
    assert cli_baseline(args + ["--benchmark", "gsm8k"]) == 0
    base = json.loads((ev / "baseline/gsm8k.json").read_text())
    assert base["n_samples"] == SPEED == len(base["sample_ids"])  # the timed sample: the first eval.speed_prompts
    for kind in ("plain", "prompt_lookup"):
        assert base[kind]["tokens_per_s"] > 0 and len(base[kind]["new_tokens"]) == SPEED
        assert all(1 <= n <= 12 for n in base[kind]["new_tokens"])

    assert cli_evaluate(args + ["--method", "dspark", "--benchmark", "gsm8k"]) == 0
    df = pd.read_csv(ev / "dspark/gsm8k.csv")
    head = ["sample_id", "round", "proposal_len", "accepted", "emitted", "draft_time_s", "verify_time_s"]
    per_pos = [f"{c}_{k}" for c in ("conf_logit", "accept_prob", "alpha") for k in range(1, 8)]
    assert list(df.columns) == head + per_pos + ["batch_size", "verify_tokens", "method", "benchmark", "domain"]
    # the timed sample alone, the rest through the batched engine, in sample order
    assert list(df["sample_id"].unique()) == [smp["sample_id"] for smp in json.loads(
        (ev / "dspark/gsm8k.json").read_text())["samples"]]
    assert df["batch_size"].max() == N_PROMPTS - SPEED and (df["verify_tokens"] == df["proposal_len"] + 1).any()
    a = df[[f"accept_prob_{k}" for k in range(1, 8)]].to_numpy()
    assert ((a[~np.isnan(a)] >= 0) & (a[~np.isnan(a)] <= 1)).all() and df["alpha_1"].notna().all()
    assert (df["method"] == "dspark").all() and (df["domain"] == "Math").all()
    assert df["conf_logit_7"].notna().all() and (df["accepted"] <= df["proposal_len"]).all()
    s = json.loads((ev / "dspark/gsm8k.json").read_text())
    assert s["n_samples"] == N_PROMPTS and s["rounds"] == len(df) and s["gamma"] == 7
    assert s["tau"] == pytest.approx(df["emitted"].mean())
    # every sample: the prefill token + the tokens of its rounds, never above max_new_tokens
    per = df.groupby("sample_id")["emitted"].sum()
    for smp in s["samples"]:
        assert smp["new_tokens"] == 1 + per.get(smp["sample_id"], 0) <= 12
    assert s["tokens_per_s"] > 0 and s["speedup_vs_plain"] > 0
    # each timed prompt was also decoded plainly beside it (same seed: at T = 1 the same first token)
    timed = [smp for smp in s["samples"] if smp.get("batch1", True)]
    assert len(timed) == SPEED and all(smp["plain_time_s"] > 0 and 1 <= smp["plain_new_tokens"] <= 12 for smp in timed)
    inter = s["speedup_interleaved"]
    assert inter["n_samples"] == SPEED and s["speedup_vs_plain"] == inter["speedup"]
    assert inter["speedup"] > 0 and inter["ci_low"] is None and inter["ci_high"] is None  # one prompt: no interval
    # DSpark (a confidence head) also decoded each timed prompt with Algorithm 1 (eval.speed_alg1): timed only
    assert all(smp["alg1_time_s"] > 0 and 1 <= smp["alg1_new_tokens"] <= 12 for smp in timed)
    assert all(0 <= smp["alg1_verified"] <= 7 * smp["alg1_rounds"] for smp in timed)
    alg1 = s["speedup_alg1"]
    assert alg1["n_samples"] == SPEED and alg1["speedup"] > 0 and alg1["ci_low"] is None
    assert 0 <= alg1["mean_verified"] <= 7
    # the summaries record the settings they were made with, which the report checks (W3)
    from deepspec.config import load_config, parse_set
    from deepspec.reporting.records import check_settings

    sets = args[3::2]
    check_settings(load_config("tiny", parse_set(sets)), s, "dspark/gsm8k.json", "evaluate")
    check_settings(load_config("tiny", parse_set(sets)), base, "baseline/gsm8k.json", "baseline")
    with pytest.raises(DeepSpecError, match="dspark/gsm8k.json was made with eval.max_new_tokens = 12, this config has 16"):
        check_settings(load_config("tiny", parse_set(sets + ["eval.max_new_tokens=16"])), s, "dspark/gsm8k.json", "evaluate")
    assert s["engine"]["requests"] == N_PROMPTS - SPEED and s["engine"]["batch_size"] == 32
    assert len(s["positions"]) == 7 and s["confidence_selfcheck"]["n_rounds"] == len(df)

    assert cli_schedule(args + ["--benchmark", "gsm8k", "--max-batch-tokens", "16"]) == 0
    sweep = pd.read_csv(ev / "dspark/gsm8k.sweep.csv")
    assert len(sweep) == 10 and sweep["accepted"].iloc[0] == pytest.approx(s["tau"])
    cal = pd.read_csv(ev / "dspark/gsm8k.calibration.csv")
    assert list(cal.columns)[:6] == ["position", "ece_before", "ece_after", "auroc", "n", "temperature"]
    assert len(cal) == 7 and (cal["ece_after"] >= 0).all()
    alg1 = json.loads((ev / "dspark/gsm8k.alg1.json").read_text())
    assert alg1["sps"]["batch_tokens"] == list(range(1, 17)) and min(alg1["sps"]["steps_per_s"]) > 0
    # whole numbers as ints: export-checkpoint --sps (SGLang's SPS table) takes this file as it is
    assert all(type(b) is int for b in alg1["sps"]["batch_tokens"])
    from deepspec.drafters import load_drafter
    from deepspec.formats.sglang import SGLANG_SPS_FILE, SGLANG_STS_FILE, sglang_files

    d = load_drafter(ev.parent / "drafters/dspark", tiny_target)
    files = sglang_files(d, sts=ev / "dspark/gsm8k.alg1.json", sps=ev / "dspark/gsm8k.alg1.json")
    assert files[SGLANG_SPS_FILE]["sample_batch_tokens"] == list(range(1, 17)) and len(files[SGLANG_STS_FILE]["temperatures"]) == 7
    assert [x["batch"] for x in alg1["simulations"]] == [1, 2]
    assert all(x["theta_alg1"] > 0 and x["theta_fixed"] > 0 for x in alg1["simulations"])


def test_user_errors_are_one_line(setup, shared_data, capsys, tmp_path):
    ev, args = setup
    assert main(["evaluate", *args, "--method", "dspark", "--benchmark", "gsm8k", "--set", "data.max_prompt_tokens=5",
                 "--out", str(tmp_path / "x.csv")]) == 2
    assert "over the limit" in capsys.readouterr().err
    assert main(["evaluate", *args, "--method", "eagle3", "--benchmark", "gsm8k"]) == 2
    assert "no drafter checkpoint" in capsys.readouterr().err
    # a drafter trained for another target
    bad = tmp_path / "bad"
    src = ev.parent / "drafters/dspark"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["deepspec_target_id"] = "some/other-model"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["evaluate", *args, "--method", "dspark", "--benchmark", "gsm8k", "--drafter", str(bad),
                 "--out", str(tmp_path / "y.csv")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("deepspec evaluate: error:") and "target id" in last
    # a damaged drafter config.json, with and without --drafter; an unknown method
    (bad / "config.json").write_text(json.dumps(cfg)[:40])
    for extra in (["--drafter", str(bad)], ["--set", f"results_dir={tmp_path / 'r'}"]):
        if "--set" in extra:
            (tmp_path / "r/tiny/drafters").mkdir(parents=True, exist_ok=True)
            (tmp_path / "r/tiny/drafters/dspark").symlink_to(bad)
        assert main(["evaluate", *args, "--method", "dspark", "--benchmark", "gsm8k", *extra,
                     "--out", str(tmp_path / "z.csv")]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("deepspec evaluate: error:") and "config.json: malformed JSON" in last, last
    assert main(["evaluate", *args, "--method", "foo", "--benchmark", "gsm8k"]) == 2
    assert "unknown method 'foo'" in capsys.readouterr().err
    # schedule needs confidence logits
    df = pd.DataFrame({"sample_id": ["a", "b"], "proposal_len": [7, 7], "accepted": [1, 2], "emitted": [2, 3]})
    df.to_csv(tmp_path / "e.csv", index=False)
    assert main(["schedule", *args, "--benchmark", "gsm8k", "--records", str(tmp_path / "e.csv")]) == 2
    assert "no confidence logits" in capsys.readouterr().err


def test_evaluate_refuses_a_drafter_of_another_method(setup, shared_data):
    from deepspec.errors import DeepSpecError

    ev, args = setup
    dspark = ev.parent / "drafters" / "dspark"
    with pytest.raises(DeepSpecError, match="is a dspark drafter, not dflash"):
        cli_evaluate(args + ["--method", "dflash", "--benchmark", "gsm8k", "--drafter", str(dspark)])


def test_disk_full_is_one_line(monkeypatch, capsys):
    import errno

    import deepspec.planning.preflight

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "results/x.csv")

    monkeypatch.setattr(deepspec.planning.preflight, "cli_show_config", full)
    assert main(["show-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "disk full writing results/x.csv" in err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    """Ctrl-C in any command (train, evaluate, ...): one line, exit status 130, no traceback."""
    import deepspec.planning.preflight

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(deepspec.planning.preflight, "cli_show_config", interrupted)
    assert main(["show-config"]) == 130
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("deepspec show-config: interrupted; nothing half-written was kept")


def test_evaluate_every_benchmark_in_one_process(setup, shared_data, tmp_path):
    """The DAG's evaluate job: every benchmark of the method, records per benchmark
    (eval.speed_alg1 off: no Algorithm 1 decoding of the timed prompts)."""
    ev, args = setup
    assert cli_evaluate(args + ["--method", "dspark", "--out-dir", str(tmp_path), "--set", "eval.batch_size=3",
                                "--set", "eval.speed_alg1=false"]) == 0
    for bench in ("gsm8k", "humaneval", "mt-bench"):
        df = pd.read_csv(tmp_path / f"{bench}.csv")
        s = json.loads((tmp_path / f"{bench}.json").read_text())
        assert (df["benchmark"] == bench).all() and s["rounds"] == len(df) and s["engine"]["batch_size"] == 3
        # one engine for the whole run: every prompt past each timed benchmark's timed sample (gsm8k 4 prompts,
        # mt-bench 2) and every prompt of humaneval (2), which the tiny preset leaves out of eval.speed_benchmarks
        assert s["engine"]["requests"] == (N_PROMPTS - SPEED) + (2 - SPEED) + 2 and df["batch_size"].max() <= 3
        timed = [x["sample_id"] for x in s["samples"] if x.get("batch1", True)]
        assert len(timed) == (0 if bench == "humaneval" else SPEED) and len(s["samples"]) == s["n_samples"]
        assert s["speedup_alg1"] is None and not any("alg1_time_s" in x for x in s["samples"])
        if bench == "humaneval":  # nothing timed: no tokens/s, no speedup
            assert s["speedup_vs_plain"] is None and s["tokens_per_s"] is None
        # what the run used, measured (the provenance record's): the tiny preset in eval.precision auto on the CPU
        env, want = s["environment"], E.eval_dtype(load_config("tiny"))
        assert (env["device"], env["target_dtype"], env["drafter_dtype"]) == ("cpu", want, want)
        assert env["hardware"]["cpu_count"] and "commit" in env["code"]


def test_over_long_prompts_are_skipped_and_named(setup, shared_data, tiny_cfg, tiny_target, tmp_path, caplog):
    """A benchmark prompt over data.max_prompt_tokens is left out (a warning names it) by baseline and evaluate
    alike, so both time the same prompts, and both summaries say how many were skipped."""
    import logging

    from deepspec.config import load_config
    from deepspec.data.prompts import benchmark_prompt_set

    ev, args = setup
    cfg = load_config("tiny", {"resources_dir": tiny_cfg["resources_dir"], "data": {
        "root": tiny_cfg["data"]["root"], "max_prompt_tokens": 10**6, "benchmarks": {"gsm8k": {"cap": N_PROMPTS}}}})
    lengths = [len(ids) for _, ids in benchmark_prompt_set(cfg, tiny_target, "gsm8k")[0]]
    limit = sorted(lengths)[-2]  # the longest prompt (at least) is over it
    over = [i for i, n in enumerate(lengths) if n > limit]
    assert over and len(over) < N_PROMPTS
    lim = ["--set", f"data.max_prompt_tokens={limit}", "--benchmark", "gsm8k"]
    with caplog.at_level(logging.WARNING, logger="deepspec.data.prompts"):
        assert cli_baseline(args + lim + ["--out-dir", str(tmp_path / "base")]) == 0
    warned = [r.getMessage() for r in caplog.records if "over data.max_prompt_tokens" in r.getMessage()]
    assert warned and all(f"#{i} " in warned[0] and f"({lengths[i]} tokens)" in warned[0] for i in over)
    assert cli_evaluate(args + lim + ["--method", "dspark", "--out", str(tmp_path / "dspark.csv")]) == 0
    base = json.loads((tmp_path / "base/gsm8k.json").read_text())
    s = json.loads((tmp_path / "dspark.json").read_text())
    for summary in (base, s):
        assert summary["n_skipped_prompts"] == len(over) and summary["max_prompt_tokens"] == limit
        assert [x["index"] for x in summary["skipped_prompts"]] == over
    assert s["n_samples"] == N_PROMPTS - len(over)
    skipped_ids = {x["sample_id"] for x in s["skipped_prompts"]}
    assert not skipped_ids & set(pd.read_csv(tmp_path / "dspark.csv")["sample_id"])
    assert base["sample_ids"] == [x["sample_id"] for x in s["samples"] if x.get("batch1", True)]


def _decoded(path):
    """A records CSV without what differs between runs: wall times, and R (which requests shared a round)."""
    return pd.read_csv(path).drop(columns=["draft_time_s", "verify_time_s", "batch_size"])


def test_interrupted_evaluate_resumes_to_the_same_records(setup, shared_data, tmp_path, monkeypatch):
    """Every finished request is appended (fsync'd) to a partial file as it finishes; an evaluate job
    killed after k requests, rerun, decodes only the others and writes the same records as a run that was
    never interrupted; the partial file is gone at the end."""

    ev, args = setup
    run = args + ["--method", "dspark", "--set", "eval.batch_size=2", "--set", "data.benchmarks.mt-bench.cap=3"]
    assert cli_evaluate(run + ["--out-dir", str(tmp_path / "whole")]) == 0
    partial = tmp_path / "cut" / ".dspark.partial.jsonl"
    real_add, calls = E.Progress.add, []

    def add_then_die(self, *a):
        real_add(self, *a)
        calls.append(a[:2])
        if len(calls) == 4:
            raise KeyboardInterrupt  # a kill after the 4th finished request (batch-1 ones and batched ones)

    monkeypatch.setattr(E.Progress, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        cli_evaluate(run + ["--out-dir", str(tmp_path / "cut")])
    assert partial.exists() and len(partial.read_text().splitlines()) == 1 + 4
    with open(partial, "a") as f:
        f.write('{"id": "gsm8k#9", "benchm')  # a torn last line, as a kill mid-write leaves
    monkeypatch.setattr(E.Progress, "add", real_add)
    resumed = []
    monkeypatch.setattr(E.Progress, "add", lambda self, *a: (resumed.append(a[:2]), real_add(self, *a)))
    assert cli_evaluate(run + ["--out-dir", str(tmp_path / "cut")]) == 0
    assert not partial.exists() and not set(resumed) & set(calls)  # the 4 finished ones were not decoded again
    for bench in ("gsm8k", "humaneval", "mt-bench"):
        pd.testing.assert_frame_equal(_decoded(tmp_path / "cut" / f"{bench}.csv"),
                                      _decoded(tmp_path / "whole" / f"{bench}.csv"))
        a, b = (json.loads((tmp_path / d / f"{bench}.json").read_text()) for d in ("cut", "whole"))
        assert a["tau"] == b["tau"] and [x["new_tokens"] for x in a["samples"]] == [x["new_tokens"] for x in b["samples"]]
    # other settings never reuse a partial file
    E.Progress(partial, {"fingerprint": "x"}).add("gsm8k", 0, [], {})
    assert E.Progress(partial, {"fingerprint": "y"}).done == {}
    for _ in range(2):  # reopened with nothing finished: still one header, nothing kept
        assert E.Progress(partial, {"fingerprint": "y"}).done == {} and len(partial.read_text().splitlines()) == 1


def test_kv_budget_caps_the_engine_rows(setup, shared_data, tmp_path):
    """eval.kv_budget_gb reaches the engine: a budget below two rows decodes one request at a time,
    with the records of the unbudgeted run; the summary says how many rows ran at once."""
    ev, args = setup
    # fp32 engine: the comparison across batch compositions is at float noise (bf16 would round them apart)
    run = args + ["--method", "dspark", "--benchmark", "gsm8k", "--set", "eval.precision=float32"]
    for name, extra in (("free", []), ("capped", ["--set", "eval.kv_budget_gb=1e-6"])):
        assert cli_evaluate(run + extra + ["--out-dir", str(tmp_path / name)]) == 0
    free, capped = (json.loads((tmp_path / d / "gsm8k.json").read_text())["engine"] for d in ("free", "capped"))
    assert free["kv_budget_gb"] is None and free["max_rows"] == N_PROMPTS - SPEED
    assert capped["kv_budget_gb"] == 1e-6 and capped["max_rows"] == 1
    # the same decisions (integer columns exactly); confidences and probabilities within float noise of the batch
    pd.testing.assert_frame_equal(_decoded(tmp_path / "capped" / "gsm8k.csv"), _decoded(tmp_path / "free" / "gsm8k.csv"),
                                  check_exact=False, rtol=1e-4, atol=1e-5)


def test_progress_survives_a_change_of_rows_and_keeps_each_prompts_own_record(tiny_cfg, tmp_path):
    """A job stopped by an out-of-memory error is rerun at a smaller eval.batch_size or
    eval.kv_budget_gb: its partial file still applies (a request's records do not depend on how many
    rows decode at once); any other evaluate setting starts afresh. A kept record is used only for the
    prompt it was made from."""

    def header(**ev):
        return E.progress_header({**tiny_cfg, "eval": {**tiny_cfg["eval"], **ev}}, "dspark", "d", ["gsm8k"])

    h = header()
    assert header(batch_size=3) == h and header(kv_budget_gb=2.5) == h
    assert header(temperature=0.5) != h and header(max_new_tokens=7) != h
    assert E.progress_header(tiny_cfg, "dflash", "d", ["gsm8k"]) != h
    path = tmp_path / ".dspark.partial.jsonl"
    E.Progress(path, h).add("gsm8k", 0, [{"round": 0}], {"sample_id": "gsm8k-a"})
    again = E.Progress(path, header(batch_size=3))
    assert again.get("gsm8k", 0, "gsm8k-a")["rows"] == [{"round": 0}]
    assert again.get("gsm8k", 0, "gsm8k-b") is None and again.get("gsm8k", 1, "gsm8k-a") is None


def test_eval_precision_reaches_the_target_and_the_drafter(setup, shared_data, tmp_path):
    """eval.precision is the dtype evaluate runs the target and the fp32-saved drafter
    in, for the timed batch-1 prompts and the batched engine alike: each decodes end to
    end and the summary's environment (measured from the loaded models' parameters)
    says so; auto is bf16 where the CPU multiplies it natively, else eval.dtype (the
    paper presets: bfloat16, as DeepSeek's reference evaluates its bf16 checkpoints)."""
    from deepspec import runtime
    from deepspec.config import load_config
    from deepspec.evaluation.evaluate import eval_dtype

    ev, args = setup
    run = args + ["--method", "dspark", "--benchmark", "gsm8k"]
    for prec in ("bfloat16", "float32"):
        out = tmp_path / prec
        assert cli_evaluate(run + ["--set", f"eval.precision={prec}", "--out-dir", str(out)]) == 0
        s = json.loads((out / "gsm8k.json").read_text())
        assert s["environment"]["target_dtype"] == s["environment"]["drafter_dtype"] == prec
        assert s["engine"]["requests"] == N_PROMPTS - SPEED and s["rounds"] > 0 and 1 <= s["tau"] <= 8
        assert s["tokens_per_s"] > 0  # the timed batch-1 prompts ran in it too
    assert load_config("tiny")["eval"]["dtype"] == "float32" and load_config("qwen3-14b")["eval"]["dtype"] == "bfloat16"
    native = runtime.bf16_matmul_support("cpu")[0]
    assert eval_dtype(load_config("tiny")) == ("bfloat16" if native else "float32")
    assert eval_dtype(load_config("tiny", {"eval": {"dtype": "bfloat16"}})) == "bfloat16"


def test_interleaved_speedup_is_the_ratio_of_pooled_rates_with_a_paired_interval():
    """Pooled tokens/s ratio; a speedup the same on every prompt has a degenerate
    interval however fast the prompts were, noisy pairs an interval around it;
    batched samples and samples without a plain side are left out."""
    from deepspec.evaluation.evaluate import interleaved_speedup

    rng = np.random.default_rng(0)
    same = [{"new_tokens": 64, "time_s": t, "plain_new_tokens": 64, "plain_time_s": 1.5 * t} for t in rng.uniform(1, 9, 12)]
    sp = interleaved_speedup(same + [{"new_tokens": 9, "time_s": 1.0, "batch1": False}], 500, 0)
    assert sp["speedup"] == pytest.approx(1.5) and sp["ci_low"] == pytest.approx(1.5) and sp["n_samples"] == 12
    assert sp["plain_tokens_per_s"] == pytest.approx(12 * 64 / sum(x["plain_time_s"] for x in same))
    noisy = [dict(x, time_s=x["time_s"] * rng.uniform(0.8, 1.25)) for x in same]
    sp = interleaved_speedup(noisy, 500, 0)
    assert sp["ci_low"] < sp["speedup"] < sp["ci_high"] and sp["ci_low"] < 1.5 < sp["ci_high"] * 1.3
    assert interleaved_speedup([{"new_tokens": 9, "time_s": 1.0}], 500, 0) is None
    one = interleaved_speedup(same[:1], 500, 0)  # one prompt: the ratio, no interval
    assert one["speedup"] == pytest.approx(1.5) and np.isnan(one["ci_low"]) and np.isnan(one["ci_high"])


def test_algorithm1_timing_needs_a_confidence_head(tiny_cfg, tiny_target):
    """eval.speed_alg1 applies to drafters with a confidence head (DSpark): the
    others get no policy and no profile; DSpark gets SPS(1..gamma+1)."""
    from deepspec import drafters
    from deepspec.evaluation.evaluate import alg1_policy
    from deepspec.settings import Settings

    s = Settings.of(tiny_cfg)
    for method in ("eagle3", "dflash"):
        assert alg1_policy(s, tiny_target, drafters.build_drafter(method, tiny_target, tiny_cfg)) is None
    pol = alg1_policy(s, tiny_target, drafters.build_drafter("dspark", tiny_target, tiny_cfg))
    assert list(pol.sps.batch_tokens) == list(range(1, 9)) and (pol.sps.steps_per_s > 0).all()


def test_the_pooled_speedup_bootstrap_is_stratified_by_benchmark():
    """Prompts from fixed strata (eval.speed_prompts per benchmark): with strata
    the interval holds only the within-benchmark spread (here none: degenerate),
    without them the between-benchmark spread widens it; a stratum of one sample
    falls back to the plain bootstrap."""
    from deepspec.evaluation.evaluate import interleaved_speedup

    def smp(r):
        return {"new_tokens": 90, "time_s": 1.0, "plain_new_tokens": 90, "plain_time_s": r}

    samples = [smp(1.3)] * 4 + [smp(0.8)] * 4
    strata = ["gsm8k"] * 4 + ["mt-bench"] * 4
    st = interleaved_speedup(samples, 500, 0, strata=strata)
    plain = interleaved_speedup(samples, 500, 0)
    assert st["speedup"] == plain["speedup"] == pytest.approx(1.05)
    assert st["ci_low"] == pytest.approx(1.05) and st["ci_high"] == pytest.approx(1.05)
    assert st["bootstrap"] == "stratified over 2 strata" and plain["bootstrap"] == "plain"
    assert plain["ci_low"] < 1.0 < 1.1 < plain["ci_high"]
    one = interleaved_speedup(samples[:5], 500, 0, strata=strata[:5])
    assert one["bootstrap"] == "plain" and one["ci_low"] < one["ci_high"]

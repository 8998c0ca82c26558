"""prepare_data: the preset's prompt files built from hub-shaped sources.

No network: the test writes small datasets in the shapes of the real hub
repositories (parquet files and README configs that `datasets.load_dataset`
reads, raw JSONL/JSON files) under a mirror directory, and points
`--hub-mirror` at it.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec import cli
from deepspec.config import load_config
from deepspec.data import sources as pd_mod
from deepspec.data.catalog import BOXED_SUFFIX
from deepspec.data.prompts import read_turns_jsonl
from deepspec.data.sources import SUMS_FILE, check_sources, prepare_data, read_sums
from deepspec.errors import DeepSpecError

from helpers import copy_workflow

REPO = Path(__file__).resolve().parents[1]
HUMANEVAL_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list, raw_lines=()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))


def _configs_readme(repo: Path, configs: dict) -> None:
    """A hub README whose YAML declares configs -> split -> parquet files."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines += [f"- config_name: {name}", "  data_files:"]
        lines += [f"  - split: {s}\n    path: {name}/{s}-*" for s in splits]
    (repo / "README.md").write_text("\n".join(lines + ["---", ""]))


def _mirror(root: Path) -> Path:
    """Every source of the CPU default preset, a few rows each, in its hub shape."""
    m = root / "mirror"
    gsm = m / "openai/gsm8k"
    _parquet(gsm / "main/test-00000-of-00001.parquet", [{"question": "Janet’s ducks lay 16 eggs?", "answer": "#### 16"}])
    _parquet(gsm / "main/train-00000-of-00001.parquet", [{"question": "Q1?", "answer": "A <<1+1=2>>2\n#### 2"}])
    _parquet(gsm / "socratic/test-00000-of-00001.parquet", [{"question": "wrong config", "answer": "x"}])
    _configs_readme(gsm, {"main": ["train", "test"], "socratic": ["test"]})
    mbpp = m / "google-research-datasets/mbpp"
    _parquet(mbpp / "sanitized/test-00000-of-00001.parquet", [{"task_id": 11, "prompt": "Write a function f.", "code": ""}])
    _parquet(mbpp / "sanitized/train-00000-of-00001.parquet", [{"task_id": 602, "prompt": "wrong split", "code": ""}])
    _parquet(mbpp / "full/test-00000-of-00001.parquet", [{"task_id": 11, "text": "wrong config", "code": ""}])
    _configs_readme(mbpp, {"full": ["test"], "sanitized": ["train", "test"]})
    _parquet(m / "HuggingFaceH4/MATH-500/test.parquet", [{"problem": "What is $1+1$?", "answer": "2"}])
    _parquet(m / "MathArena/aime_2025/data/train-00000-of-00001.parquet", [{"problem": "Find x.", "answer": 70}])
    _parquet(m / "openai/openai_humaneval/openai_humaneval/test-00000-of-00001.parquet",
             [{"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"doc\"\"\"\n", "test": ""}])
    _parquet(m / "HuggingFaceH4/mt_bench_prompts/data/train-00000-of-00001.parquet",
             [{"prompt": ["Write a poem.", "Now shorter."], "category": "writing"}])
    _parquet(m / "tatsu-lab/alpaca/data/train-00000-of-00001.parquet",
             [{"instruction": "Give a tip.", "input": "", "output": "Sleep."},
              {"instruction": "Sum these.", "input": "1, 2", "output": "3"}])
    lcb = m / "livecodebench/code_generation_lite"
    _jsonl(lcb / "test.jsonl", [{"question_content": "Add two numbers.", "starter_code": ""},
                                {"question_content": "Reverse.", "starter_code": "class Solution:\n    pass"}])
    _jsonl(lcb / "test2.jsonl", [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "U1"}]}])
    for i in (3, 4, 5, 6):
        _jsonl(lcb / f"test{i}.jsonl", [])
    _jsonl(m / "lmarena-ai/arena-hard-auto/data/arena-hard-v2.0/question.jsonl",
           [{"uid": "a", "category": "hard_prompt", "prompt": "Write a zig program."}])
    code = m / "github.com/sahil280114/codealpaca/data/code_alpaca_2k.json"
    code.parent.mkdir(parents=True)
    code.write_text(json.dumps([{"instruction": "Sort it.", "input": "[3, 1]", "output": "[1, 3]"},
                                {"instruction": "Say hi.", "input": "", "output": ""}]))
    libre = m / "github.com/mobarski/alpaca-libre/data/output/work"
    _jsonl(libre / "alpaca_libre_tasks_v1.jsonl",
           [{"instruction": "Name a color.", "input": "<noinput>", "output": "Red. ", "status": "ok"},
            {"instruction": "Too close.", "input": "", "output": "x", "status": "too similar"}])
    _jsonl(libre / "alpaca_libre_tasks_v2.jsonl", [{"instruction": "Name a color.", "input": "", "output": "Blue", "status": "ok"}],
           raw_lines=['{"status": "ok", "instruction": "broken", "input": """", "output": "x"}\n'])
    _jsonl(libre / "alpaca_libre_tasks_v3.jsonl",
           [{"instruction": "Fix it.", "input": "I seen it.", "output": "<nooutput>", "status": "ok"}])
    return m


@pytest.fixture
def built(tmp_path, monkeypatch, caplog):
    import datasets

    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    mirror = _mirror(tmp_path)
    cfg = load_config("smollm2-135m", {"data": {"root": str(tmp_path / "data")}})
    with caplog.at_level("INFO", logger="deepspec.data.sources"):
        # the tiny fixtures differ from the reference copies: accepted by name
        status = prepare_data(cfg, mirror=mirror, accept=pd_mod.needed_files(cfg))
    return cfg, tmp_path / "data", status, list(caplog.records)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_builds_every_file_of_the_preset_in_deepspec_format(built):
    cfg, root, status, _ = built
    assert set(status) == set(pd_mod.needed_files(cfg)) and set(status.values()) == {"built"}
    ev = lambda name: _records(root / "eval" / name)  # noqa: E731
    assert ev("gsm8k.jsonl") == [{"turns": ["Janet’s ducks lay 16 eggs?" + BOXED_SUFFIX]}]
    assert "Janet’s".encode() in (root / "eval/gsm8k.jsonl").read_bytes()  # ensure_ascii=False, as DeepSpec's files
    assert ev("math500.jsonl") == [{"turns": ["What is $1+1$?" + BOXED_SUFFIX]}]
    assert ev("aime25.jsonl") == [{"turns": ["Find x." + BOXED_SUFFIX]}]
    assert ev("mbpp.jsonl") == [{"turns": ["Write a function f."]}]  # sanitized config, test split
    assert ev("humaneval.jsonl") == [{"turns": [HUMANEVAL_HEAD + "def f(x):\n    \"\"\"doc\"\"\"\n\n```"]}]
    assert ev("mt-bench.jsonl") == [{"turns": ["Write a poem.", "Now shorter."]}]
    assert ev("alpaca.jsonl") == [{"turns": ["Give a tip."]}, {"turns": ["Sum these.\n\nInput:\n1, 2"]}]
    lcb = ev("livecodebench.jsonl")
    assert len(lcb) == 3 and lcb[2] == {"turns": ["U1"]}
    assert "### Question:\nAdd two numbers.\n\n### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```" in lcb[0]["turns"][0]
    assert "Use the following code structure:\n```python\nclass Solution:\n    pass\n```" in lcb[1]["turns"][0]
    assert ev("arena-hard-v2.jsonl") == [{"turns": ["Write a zig program."]}]
    tr = lambda name: _records(root / "train" / name)  # noqa: E731
    assert tr("gsm8k_train.jsonl") == [{"turns": ["Q1?"], "reference": "A <<1+1=2>>2\n#### 2"}]
    assert tr("code_alpaca_2k.jsonl") == [{"turns": ["Sort it.\n\nInput:\n[3, 1]"], "reference": "[1, 3]"},
                                          {"turns": ["Say hi."]}]
    # status "ok" only, malformed source lines skipped, <noinput>/<nooutput> empty, repeated turns dropped
    assert tr("chat_alpaca_libre.jsonl") == [{"turns": ["Name a color."], "reference": "Red."},
                                             {"turns": ["Fix it.\n\nInput:\nI seen it."]}]
    for rel in status:  # the shape prompts.py reads
        assert read_turns_jsonl(root / rel)


def test_sha256_recorded_and_accepted_mismatch_warns(built):
    cfg, root, status, records = built
    sums = read_sums(root)
    assert set(sums) == set(status)
    for rel, sha in sums.items():
        assert sha == hashlib.sha256((root / rel).read_bytes()).hexdigest()
    assert (root / SUMS_FILE).read_text().splitlines()[0].split("  ")[1] == sorted(sums)[0]  # sha256sum -c format
    warned = {r.getMessage().split(":")[0] for r in records if r.levelname == "WARNING"}
    # the tiny fixtures differ from the reference copies (accepted); alpaca has no reference sha
    assert "eval/gsm8k.jsonl" in warned and "train/chat_alpaca_libre.jsonl" in warned
    assert "eval/alpaca.jsonl" not in warned
    assert all("accepted (--accept-changed-sources)" in r.getMessage() for r in records if r.levelname == "WARNING")


def test_built_files_record_their_source_and_commit(built):
    """SOURCES.json (the provenance record's): per built file its source, the
    requested revision, the commit it resolved to (read from a mirror: the pin,
    or none when the source pins no commit) and the sha256 in SHA256SUMS."""
    from deepspec.provenance import DATA_SOURCES_FILE

    cfg, root, status, _ = built
    recs, sums = json.loads((root / DATA_SOURCES_FILE).read_text()), read_sums(root)
    assert set(recs) == set(status)
    for rel, rec in recs.items():
        src = pd_mod.source_for(cfg, rel)
        assert rec["sha256"] == sums[rel] and rec["source"] == src.where and rec["revision"] == src.revision
        assert rec["mirror"] == str(root.parent / "mirror")
    assert recs["eval/gsm8k.jsonl"]["commit"] == pd_mod.KNOWN_SOURCES["eval/gsm8k.jsonl"].revision
    assert recs["train/code_alpaca_2k.jsonl"]["commit"] == "2f78ddc5c682ed6738ad092bbbfa59ba915afcb0"
    assert recs["eval/aime25.jsonl"]["commit"] is None and recs["eval/aime25.jsonl"]["commit_from"].startswith("unresolved")


def test_expected_sha_from_the_preset(built, caplog):
    cfg, root, _, _ = built
    rel = "eval/gsm8k.jsonl"
    sha = read_sums(root)[rel]
    mirror = root.parent / "mirror"
    (root / rel).unlink()
    c = load_config("smollm2-135m", {"data": {"root": str(root), "sources": {rel: {"sha256": sha}}}})
    caplog.clear()
    assert prepare_data(c, [rel], mirror=mirror) == {rel: "built"}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # a preset pin the source does not give: an error, nothing written, SHA256SUMS untouched
    (root / rel).unlink()
    sums_before = (root / SUMS_FILE).read_bytes()
    c = load_config("smollm2-135m", {"data": {"root": str(root), "sources": {rel: {"sha256": "0" * 64}}}})
    with pytest.raises(DeepSpecError, match=f"^{rel}: sha256 {sha} differs from the reference copy's") as e:
        prepare_data(c, [rel], mirror=mirror)
    assert "\n" not in str(e.value) and f"--accept-changed-sources {rel}" in str(e.value)
    assert not (root / rel).exists() and (root / SUMS_FILE).read_bytes() == sums_before
    assert not [p for p in (root / "eval").iterdir() if p.name.startswith(".")]  # no temp file left


def test_wrong_mirror_file_is_refused_unless_accepted_by_name(tmp_path, monkeypatch, capsys):
    """The hostile case: a mirror whose GSM8K test split is 1 record, not 1319."""
    import datasets

    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    mirror, data, rel = _mirror(tmp_path), tmp_path / "data", "eval/gsm8k.jsonl"
    base = ["prepare-data", "--preset", "tiny", "--set", f"data.root={data}", "--hub-mirror", str(mirror),
            "--file", rel]
    for _ in range(2):  # a rerun is refused too: nothing was recorded
        rc = cli.main(base)
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"deepspec prepare-data: error: {rel}: sha256 ") and "reference copy" in err[0]
        assert not data.exists() or not [p for p in data.rglob("*") if p.is_file()]  # SHA256SUMS neither
    # a name that is not checked here is refused (a typo accepts nothing)
    assert cli.main(base + ["--accept-changed-sources", "eval/gsm8k.json"]) == 2
    assert "not among the files" in capsys.readouterr().err and not (data / rel).exists()
    # accepted by name: written and recorded; the next run finds it present, silently
    assert cli.main(base + ["--accept-changed-sources", rel]) == 0
    assert len(_records(data / rel)) == 1 and set(read_sums(data)) == {rel}
    capsys.readouterr()
    assert cli.main(base) == 0
    assert "WARNING" not in capsys.readouterr().err


def test_present_files_are_not_touched_nor_downloaded(built, monkeypatch, caplog):
    cfg, root, status, _ = built
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}

    def no_download(*a, **k):
        raise AssertionError("downloaded")

    monkeypatch.setattr(pd_mod, "_open_rows", no_download)
    caplog.clear()
    assert set(prepare_data(cfg, offline=True).values()) == {"present"}
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()} == before
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # shas match SHA256SUMS
    # a file changed after it was built: an error naming it; SHA256SUMS untouched
    (root / "eval/mbpp.jsonl").write_text('{"turns": ["edited"]}\n')
    sums = read_sums(root)
    with pytest.raises(DeepSpecError, match="^eval/mbpp.jsonl: .*changed after it was built") as e:
        prepare_data(cfg, offline=True)
    assert "\n" not in str(e.value) and read_sums(root) == sums
    # accepted by name: a warning, and the new sha is recorded
    caplog.clear()
    prepare_data(cfg, offline=True, accept=["eval/mbpp.jsonl"])
    msgs = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(msgs) == 1 and msgs[0].startswith("eval/mbpp.jsonl") and "changed after it was built" in msgs[0]
    assert read_sums(root)["eval/mbpp.jsonl"] == hashlib.sha256((root / "eval/mbpp.jsonl").read_bytes()).hexdigest()
    caplog.clear()
    prepare_data(cfg, offline=True)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_offline_missing_file_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    rc = cli.main(["prepare-data", "--preset", "tiny", "--set", f"data.root={tmp_path}", "--offline"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("deepspec prepare-data: error: prompt file")
    assert "train/gsm8k_train.jsonl" in err[0] and "openai/gsm8k@" in err[0] and "prepare-data --preset tiny" in err[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_each_offline_variable_stops_downloads(tmp_path, monkeypatch, var):
    """One offline switch (runtime.hub_offline), read under each of the names the
    Hugging Face libraries use: the prompt sources and the target-facts check
    both honour every one."""
    from deepspec.targets import specs

    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(var, "True")

    def no_network(*a, **k):
        raise AssertionError("tried the network")

    monkeypatch.setattr(pd_mod, "_open_rows", no_network)
    monkeypatch.setattr(specs.socket, "create_connection", no_network)
    cfg = load_config("tiny", {"data": {"root": str(tmp_path / "data")}})
    with pytest.raises(DeepSpecError, match=f"offline: --offline or .*{var}.* is set"):
        prepare_data(cfg)
    assert specs.check_against_hub({}, "x/y") == {"checked": False, "reason": "offline"}


def test_unreachable_source_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    cfg = load_config("tiny", {"data": {"root": str(tmp_path / "data")}})
    with pytest.raises(DeepSpecError) as e:
        prepare_data(cfg, ["eval/livecodebench.jsonl"], mirror=tmp_path / "empty_mirror")
    msg = str(e.value)
    assert "\n" not in msg and "livecodebench/code_generation_lite" in msg and "FileNotFoundError" in msg
    assert not (tmp_path / "data").exists()


def test_missing_file_without_a_source_fails_at_plan_time(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    bench = {"nope": {"path": "eval/nope.jsonl", "domain": "Chat"}}
    cfg = load_config("tiny", {"data": {"root": str(tmp_path), "benchmarks": bench}})
    with pytest.raises(DeepSpecError, match="eval/nope.jsonl is missing and has no known source"):
        check_sources(cfg)
    cfg = load_config("tiny", {"data": {"root": str(tmp_path), "benchmarks": bench,
                                        "sources": {"eval/nope.jsonl": {"hub": "me/nope", "format": "prompt"}}}})
    check_sources(cfg)
    assert pd_mod.source_for(cfg, "eval/nope.jsonl").where == "me/nope train"


def test_the_dag_builds_only_missing_files(tmp_path, shared_data):
    copy_workflow(tmp_path)
    data = tmp_path / "data"
    for rel in ["train/gsm8k_train.jsonl", "train/chat_alpaca_libre.jsonl", "eval/gsm8k.jsonl", "eval/mt-bench.jsonl"]:
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared_data / rel, data / rel)
    env = dict(os.environ, DEEPSPEC_DATA=str(data))
    r = subprocess.run([sys.executable, "-m", "snakemake", "figures/fig2.pdf", "-n", "--cores", "1",
                        "--config", "preset=tiny"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    jobs = [line.split()[1] for line in out.splitlines() if line.startswith("prepare_data ")]
    assert jobs and set(jobs) == {"1"}, out[-3000:]  # only eval/humaneval.jsonl is missing
    assert f"output: {data}/eval/humaneval.jsonl" in out

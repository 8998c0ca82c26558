"""Hub snapshots at pinned revisions (deepspec/fetch.py): the training dataset and
DeepSeek's released drafters are fetched by local rules where Snakemake runs,
at the revision the preset names, which reaches the download and the
fingerprints of the rules that read them."""
import json
import re
from pathlib import Path

import pytest

from deepspec.config import load_config, settings_fingerprint
from deepspec.errors import DeepSpecError
from deepspec.fetch import fetch_snapshot, snapshot_name
from deepspec.provenance import SOURCE_FILE

from helpers import copy_workflow, local_rules, snakemake

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RELEASED = {"hub": "deepseek-ai/dspark_qwen3_4b_block7", "revision": "r-pinned"}


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub.snapshot_download answered from a fake hub cache: a dataset
    (one JSONL file of ShareGPT conversations) or a checkpoint, under
    snapshots/<commit>/ as the real cache keeps them; every call is recorded."""
    import huggingface_hub

    calls = []

    def download(repo_id, repo_type=None, revision=None, allow_patterns=None, **kw):
        calls.append({"repo_id": repo_id, "repo_type": repo_type, "revision": revision, "allow": allow_patterns})
        snap = tmp_path / "hub-cache" / repo_id.replace("/", "--") / "snapshots" / COMMIT
        if repo_type == "dataset":
            (snap / "data").mkdir(parents=True, exist_ok=True)
            rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"}]}
                    for i in range(3)]
            (snap / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            snap.mkdir(parents=True, exist_ok=True)
            (snap / "config.json").write_text("{}")
            (snap / "model.safetensors").write_bytes(b"weights")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return calls


def _hub_cfg(tmp_path, revision="r-pinned", **eval_):
    return load_config("tiny", {"resources_dir": str(tmp_path / "resources"), "eval": eval_,
                                "data": {"train": [{"path": "hub:someone/chats", "revision": revision}]}})


def test_the_pinned_revision_reaches_the_download_and_the_fingerprints(tmp_path, fake_hub, monkeypatch):
    import datasets

    from deepspec.data.prompts import load_train_prompts
    from deepspec.evaluation.evaluate import drafter_path

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    cfg = _hub_cfg(tmp_path, released_checkpoints={"dspark": RELEASED})
    prompts = load_train_prompts(cfg)  # a command run by hand fetches what the DAG's rule would have
    assert [p.turns for p in prompts] == [[f"question {i}"] for i in range(3)]
    assert prompts[0].id == "someone/chats:0"  # ids name the dataset, not where its snapshot lies
    assert fake_hub == [{"repo_id": "someone/chats", "repo_type": "dataset", "revision": "r-pinned", "allow": None}]
    snap = tmp_path / "resources" / "hub" / "datasets" / "someone--chats@r-pinned"
    rec = json.loads((snap / SOURCE_FILE).read_text())
    assert (rec["repo_id"], rec["revision"], rec["commit"]) == ("someone/chats", "r-pinned", COMMIT)
    load_train_prompts(cfg)
    assert len(fake_hub) == 1  # fetched once: the snapshot on disk is read again

    path = Path(drafter_path(cfg, "dspark"))
    assert fake_hub[1] == {"repo_id": RELEASED["hub"], "repo_type": "model", "revision": "r-pinned",
                           "allow": ["*.json", "*.safetensors"]}
    assert path == tmp_path / "resources" / "hub" / "models" / "deepseek-ai--dspark_qwen3_4b_block7@r-pinned"
    assert (path / "model.safetensors").read_bytes() == b"weights"

    # the revisions are part of what the rules that read them fingerprint
    other = _hub_cfg(tmp_path, "r-other", released_checkpoints={"dspark": dict(RELEASED, revision="r-other")})
    assert settings_fingerprint(cfg, "regenerate") != settings_fingerprint(other, "regenerate")
    assert settings_fingerprint(cfg, "evaluate") != settings_fingerprint(other, "evaluate")


def test_a_branch_revision_is_resolved_once_and_the_commit_reaches_the_provenance(tmp_path, fake_hub, shared_data):
    """NR10: a hub dataset at a branch (qwen3-4b's Open-PerfectBlend at `main`: no commit of
    it could be read when the preset was written) is not a pin. The fetch resolves it once;
    results/provenance.json and REPORT.md give the commit it resolved to, say that the
    revision is a branch, and when it was resolved. A pinned commit is recorded as pinned."""
    from deepspec.fetch import snapshot_dir
    from deepspec.reporting.run_record import _data, provenance_markdown
    from deepspec.settings import Settings

    def recorded(revision):
        cfg = load_config("tiny", {"resources_dir": str(tmp_path / "resources"), "data": {
            "root": str(shared_data), "train": [{"path": "hub:someone/chats", "revision": revision}]}})
        return cfg, _data(Settings.of(cfg))["hub:someone/chats"]

    cfg, rec = recorded("main")
    assert rec["commit"] is None and "not fetched yet" in rec["commit_from"]
    fetch_snapshot("someone/chats", "main", snapshot_dir(cfg, "dataset", "someone/chats", "main"), repo_type="dataset")
    cfg, rec = recorded("main")
    assert (rec["source"], rec["revision"], rec["commit"]) == ("someone/chats", "main", COMMIT)
    assert re.fullmatch(r"branch or tag 'main' \(not a pin\), resolved by the fetch at \d{4}-.*", rec["commit_from"])
    row = [line for line in provenance_markdown({
        "packages": {}, "hardware": {"gpus": [], "cpu": "x", "cpus_usable": 1, "cpu_count": 1, "memory_gib": 1,
                                     "cuda_available": False, "torch_cuda": None},
        "dtypes": {"target": "float32", "cache": None}, "code": {"package_dir": ".", "git_error": "none"},
        "target": {"spec": "tiny", "recorded": False, "note": "-"}, "data": {"hub:someone/chats": rec},
        "drafters": {}}) if line.startswith("| hub:someone/chats")]
    assert row == [f"| hub:someone/chats | someone/chats | main (a branch or tag, not a pin) | {COMMIT[:12]} | "
                   "not recorded | no reference |"]
    fetch_snapshot("someone/chats", COMMIT, snapshot_dir(cfg, "dataset", "someone/chats", COMMIT), repo_type="dataset")
    _, rec = recorded(COMMIT)
    assert (rec["commit"], rec["commit_from"]) == (COMMIT, "pinned revision")
    assert len(fake_hub) == 2  # each revision fetched once; the record is read, not the hub


def test_hub_sources_need_a_revision_and_never_replace_what_we_did_not_write(tmp_path, fake_hub):
    with pytest.raises(DeepSpecError, match=r"data.train.0: 'revision' is a required property"):
        load_config("tiny", {"data": {"train": [{"path": "hub:someone/chats"}]}})
    with pytest.raises(DeepSpecError, match="released_checkpoints.dspark"):
        load_config("tiny", {"eval": {"released_checkpoints": {"dspark": {"hub": RELEASED["hub"]}}}})
    for qwen in ("qwen3-4b", "rehearsal-qwen3"):
        for e in load_config(qwen)["data"]["train"]:
            assert e["path"].startswith("hub:") == ("revision" in e), (qwen, e)
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DeepSpecError, match="exists"):
        fetch_snapshot("someone/chats", "r1", out, repo_type="dataset")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    fetch_snapshot("someone/chats", "r1", tmp_path / "ours", repo_type="dataset")
    with pytest.raises(DeepSpecError, match="holds someone/chats@r1, not someone/chats@r2"):
        fetch_snapshot("someone/chats", "r2", tmp_path / "ours", repo_type="dataset")


def test_dry_run_fetches_the_pinned_revisions_in_local_rules(tmp_path):
    """qwen3-4b (Open-PerfectBlend from the hub) with a released DSpark: the plan
    fetches both in local rules (they run where Snakemake runs, not on compute
    nodes) at the preset's revisions, before the regeneration shards and the
    evaluation that read them."""
    copy_workflow(tmp_path)
    released = "eval={released_checkpoints: {dspark: {hub: deepseek-ai/dspark_qwen3_4b_block7, revision: r-pinned}}}"
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "1", "--config", "preset=qwen3-4b", released)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    dataset = snapshot_name("mlabonne/open-perfectblend", load_config("qwen3-4b")["data"]["train"][0]["revision"])
    rec = {"dataset": f"resources/hub/datasets/{dataset}/{SOURCE_FILE}",
           "released": f"resources/hub/models/deepseek-ai--dspark_qwen3_4b_block7@r-pinned/{SOURCE_FILE}"}
    assert re.search(rf"rule fetch_dataset:\n\s+output: {re.escape(rec['dataset'])}", out)
    assert re.search(rf"rule fetch_released:\n\s+output: {re.escape(rec['released'])}", out)
    assert "deepspec fetch-hub --repo-type model --allow '*.json' --allow '*.safetensors' --repo " \
           "deepseek-ai/dspark_qwen3_4b_block7 --revision r-pinned" in out
    assert re.search(r"rule regenerate_shard:\n\s+input: [^\n]*" + re.escape(rec["dataset"]), out)
    assert re.search(r"rule evaluate:\n\s+input: [^\n]*" + re.escape(rec["released"]), out)
    assert {"fetch_dataset", "fetch_released"} <= set(local_rules(tmp_path) or [])

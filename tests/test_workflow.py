"""The DAG itself: the tiny preset end to end, and dry runs of every preset."""
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from deepspec.config import PRESETS_DIR, load_config
from deepspec.reporting.report import FIG2_COLUMNS, FIG2_RB_COLUMNS, TABLE1_COLUMNS
from helpers import copy_workflow, local_rules, snakemake

REPO = Path(__file__).resolve().parents[1]






@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_dry_run_plans_every_preset(tmp_path, preset):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "1", "--config", f"preset={preset}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    for rule in ["prepare_target", "regenerate", "train", "evaluate", "baseline", "report"]:
        assert rule in out, f"{rule} missing from the plan of {preset}"


def test_train_start_first_orders_training_jobs(tmp_path):
    """train.start_first raises those methods' training jobs above the others (1),
    in its order; a name that is no method of the preset stops the plan."""
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny",
                   "train={start_first: [dspark, eagle3]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    prio = dict(re.findall(r"method=(\w+)\n\s+priority: (\d+)", r.stdout + r.stderr))
    assert prio == {"dspark": "3", "eagle3": "2", "dflash": "1"}, prio
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny",
                   "train={start_first: [eagle]}")
    assert r.returncode != 0 and "train.start_first: 'eagle' is none of this preset's methods" in r.stdout + r.stderr


def _readme_snakemake_commands():
    """The `snakemake ...` lines of the README's bash blocks (comments dropped)."""
    cmds, in_bash = [], False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if in_bash and line.startswith("snakemake "):
            cmds.append(shlex.split(line.split(" #")[0]))
    return cmds


@pytest.mark.parametrize("cmd", _readme_snakemake_commands(), ids=" ".join)
def test_readme_commands_plan(tmp_path, cmd):
    """Every DAG command the README shows parses and plans (as a dry run); e.g.
    a target placed after `--config` would be read as a config entry."""
    if "--report" in cmd or "--profile" in cmd:
        pytest.skip("needs a finished run / the SLURM executor plugin")
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", *cmd[1:])
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout[-2000:] + r.stderr[-2000:]


def test_bad_config_key_stops_the_run(tmp_path):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", "--cores", "1", "--config", "preset=tiny", "trian={epochs: 1}")
    assert r.returncode != 0 and "unknown key 'trian'" in (r.stdout + r.stderr)


@pytest.mark.slow
def test_tiny_preset_end_to_end(tmp_path, shared_data):
    copy_workflow(tmp_path)
    env = dict(os.environ, DEEPSPEC_DATA=str(shared_data), HF_HUB_OFFLINE="1")
    r = snakemake(tmp_path, "figures/fig2.pdf", "--cores", "2", "--config", "preset=tiny", env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "figures" / "fig2.pdf").read_bytes()[:5] == b"%PDF-"
    t1 = pd.read_csv(tmp_path / "results" / "tables" / "table1.csv")
    assert list(t1.columns[: len(TABLE1_COLUMNS)]) == TABLE1_COLUMNS
    drafts = t1[t1.method.isin(["eagle3", "dflash", "dspark"])]
    assert len(drafts) == 3 * 3 and (drafts.tau >= 1).all() and (drafts.tau <= 8).all()
    assert set(t1.method) >= {"plain", "prompt_lookup"}
    # eval.speed_benchmarks: gsm8k and mt-bench timed (tokens/s, speedup, baselines); humaneval only batched
    timed = t1.benchmark.isin(["gsm8k", "mt-bench"])
    assert (t1[timed].tokens_per_s > 0).all() and (t1[timed].speedup > 0).all()
    assert t1[~timed].method.isin(["eagle3", "dflash", "dspark"]).all() and t1[~timed].speedup.isna().all()
    assert (t1[~timed].n_samples == 2).all()  # both of its prompts, through the engine
    f2 = pd.read_csv(tmp_path / "results" / "tables" / "fig2.csv")
    assert list(f2.columns) == FIG2_COLUMNS + FIG2_RB_COLUMNS and set(f2.domain) == {"Math", "Code", "Chat"}
    p1 = f2[f2.position == 1]
    assert p1.acceptance_rb.between(0, 1).all() and (p1.rb_ci_low <= p1.rb_ci_high).all()
    assert (tmp_path / "results" / "REPORT.md").read_text().startswith("# DeepSpec replication report")
    # provenance.json: the checkout of the package the jobs ran (not the working directory, no checkout), what
    # prepare_target, training and evaluation recorded
    prov = json.loads((tmp_path / "results" / "provenance.json").read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert prov["code"]["git"]["commit"] == head and prov["target"]["kind"] == "random"
    for method, d in prov["drafters"].items():
        assert d["training"]["mixed_precision"] == "no" and d["training"]["code"]["commit"] == head, method
        assert [(e["device"], e["target_dtype"]) for e in d["evaluation"]] == [("cpu", "float32")], method
    assert "## Provenance" in (tmp_path / "results" / "REPORT.md").read_text()
    # A rerun has nothing to do.
    r2 = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny", env=env)
    assert "Nothing to be done" in r2.stdout + r2.stderr
    # A changed setting reruns exactly the rules that depend on it, and their descendants.
    for override, want in CHANGES.items():
        assert _planned(tmp_path, env, override) == want, override


EVAL = {"evaluate": 3, "report": 1}  # one evaluate job per method (all benchmarks)
CHANGES = {  # tiny preset: 3 drafters, 3 benchmarks
    "eval={max_new_tokens: 12}": {"baseline": 2, **EVAL},  # eval.baseline_jobs: 2
    "regenerate={temperature: 0.5}": {"regenerate_shard": 2, "regenerate": 1, "build_cache": 1, "train": 3, **EVAL},
    "cache={shard_tokens: 1000}": {"build_cache": 1, "train": 3, **EVAL},
    "train={lr: 0.001}": {"train": 3, **EVAL},
    "description=another": {"report": 1},
    "regenerate={concurrency: 3}": {},  # execution only
}


def _planned(cwd, env, *overrides) -> dict:
    """{rule: jobs} that `snakemake -n` plans with extra --config entries."""
    r = snakemake(cwd, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny", *overrides, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    if "Nothing to be done" in out:
        return {}
    stats = out.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M) if m.group(1) != "all"}


def test_rules_do_not_change_with_the_job_counts(tmp_path, shared_data):
    """regenerate.shards 1 and eval.baseline_jobs 1 plan the same rules as any other
    count: one regenerate_shard job that regenerate merges, one baseline job timing
    every timed benchmark in one process."""
    copy_workflow(tmp_path)
    env = dict(os.environ, DEEPSPEC_DATA=str(shared_data))
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "2", "--config", "preset=tiny",
                   "regenerate={shards: 1}", "eval={baseline_jobs: 1}", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    stats = out.split("Job stats:", 1)[1].split("total", 1)[0]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}
    assert {k: jobs.get(k) for k in ("regenerate_shard", "regenerate", "baseline")} == \
        {"regenerate_shard": 1, "regenerate": 1, "baseline": 1}, jobs
    cmds = _shell_commands(out)
    assert any("--shard 0/1 --out results/tiny/regen/shards/conversations.0-of-1.jsonl" in c
               for c in cmds)
    assert any("--merge results/tiny/regen/shards/conversations.0-of-1.jsonl" in c for c in cmds)
    assert [c for c in cmds if "deepspec baseline" in c and "--benchmark gsm8k --benchmark mt-bench --out-dir" in c]


def test_cheap_rules_run_where_snakemake_runs(tmp_path):
    """The rules that only convert, download or plot are local rules: on SLURM they
    run beside Snakemake (which has the internet) instead of waiting for a node."""
    copy_workflow(tmp_path)
    local = local_rules(tmp_path)
    assert local == ["ablation", "fetch_dataset", "fetch_released", "fig7", "prepare_data", "prepare_target",
                     "report"], local


def _shell_commands(out: str) -> list[str]:
    return [line.split("Shell command: ", 1)[1] for line in out.splitlines() if "Shell command: " in line]


def test_gpu_jobs_claim_their_own_gpus(tmp_path):
    """On one machine each GPU job takes GPU ids no other job holds (claim-gpus),
    instead of every evaluation landing on GPU 0; GPU training grows its memory in
    expandable segments; local regeneration shards take a GPU each."""
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "1", "--config", "preset=qwen3-4b",
                   "regenerate={backend: local, shards: 2, server: null}", "resources={regenerate: {gpu: 1}}", "cache={mode: offline}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cmds = _shell_commands(r.stdout + r.stderr)
    by = {}
    for c in cmds:
        kind = re.findall(r"-m deepspec ([\w-]+)", c)[-1]  # the job's own command (after claim-gpus)
        by[c] = "shard" if kind == "regenerate" and "--shard" in c else kind
    assert {"evaluate", "baseline", "train", "shard", "regenerate", "prepare-target", "build-cache"} <= set(by.values())
    assert "CUDA_VISIBLE_DEVICES" not in " ".join(cmds)
    for c, kind in by.items():
        want = {"evaluate": "claim-gpus 1 -- python -m deepspec evaluate", "baseline": "claim-gpus 1 -- ",
                "shard": "claim-gpus 1 -- ", "build-cache": "claim-gpus 1 -- ",
                "train": "claim-gpus 8 -- accelerate launch"}.get(kind)
        assert (want in c) if want else ("claim-gpus" not in c), c
    train = [c for c, k in by.items() if k == "train"]
    assert len(train) == 3 and all("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in c for c in train)
    # each method its own rendezvous port, a number in the command (not computed by the shell)
    base = load_config("qwen3-4b")["train"]["main_process_port"]
    ports = [int(m.group(1)) for c in train for m in [re.search(r"--main_process_port (\d+) -m deepspec train", c)] if m]
    assert len(ports) == 3 and len(set(ports)) == 3 and all(base <= p < base + 1000 for p in ports), train


def test_multi_node_training_plans(tmp_path):
    """train.nodes 2 x train.gpus 8: a 16-GPU, 2-node job whose srun overlaps the
    executor's job step and asks each node for its 8 GPUs; resources.train.nodes
    (the README's spelling) is accepted when it agrees."""
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, str(Path("results/qwen3-4b/drafters/dspark/config.json")), "-n", "-p", "--cores", "1",
                   "--config", "preset=qwen3-4b", "train={gpus: 8, nodes: 2}", "resources={train: {nodes: 2}}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    train = [c for c in _shell_commands(out) if "deepspec train" in c]
    assert len(train) == 1 and "srun --overlap --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 " in train[0]
    assert "claim-gpus" not in train[0]
    assert re.search(r"gpu=16, nodes=2", out), out[-3000:]
    r = snakemake(tmp_path, "-n", "--cores", "1", "--config", "preset=qwen3-4b", "train={gpus: 8, nodes: 2}",
                   "resources={train: {nodes: 3}}")
    assert r.returncode != 0 and "resources.train.nodes (3) differs from train.nodes (2)" in r.stdout + r.stderr


def test_slurm_profile_warns_training_before_the_time_limit(tmp_path):
    """The SLURM profile sends the train jobs (only) SIGTERM 15 min ahead of their
    time limit (their checkpoint-and-stop signal). Planned with the profile minus its
    executor, as the slurm plugin is not installed here."""
    import yaml

    copy_workflow(tmp_path)
    prof = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    prof.pop("executor")
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "config.yaml").write_text(yaml.safe_dump(prof))
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--profile", "prof", "--config", "preset=qwen3-4b")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = re.findall(r"rule (\w+):\n(?:    .*\n)*?    resources: (.*)", r.stdout + r.stderr)
    signalled = sorted({name for name, res in jobs if "slurm_extra=--signal=TERM@900" in res})
    assert signalled == ["train"], jobs[:3]
def _server_config(port: int) -> str:
    return ("regenerate={backend: server, server: {command: 'python -m deepspec serve {model} --host {host} "
            f"--port {{port}} --served-model-name {{name}} --max-tokens 64', port: {port}, threads: 1}}}}")


def test_regeneration_waits_for_no_server_before_gpu_jobs(tmp_path):
    """With regenerate.server the server is a service job grouped with the
    shards, and the baselines and evaluations wait for the merged conversations
    (so for the server to be gone); without it they do not."""
    copy_workflow(tmp_path)
    conv = "results/tiny/regen/conversations.jsonl"
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "3", "--config", "preset=tiny", _server_config(30999))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Group job regenerate" in out and "results/tiny/regen/server.service (service)" in out
    assert "exec python -m deepspec serve resources/targets/tiny --host 127.0.0.1 --port 30999" in out
    jobs = re.split(r"\n\s*(?:local)?rule ", out)
    for name, n in (("baseline:", 2), ("evaluate:", 3)):
        blocks = [j for j in jobs if j.startswith(name)]
        assert len(blocks) == n and all(conv in j.split("\n")[1] for j in blocks), name
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny")
    jobs = re.split(r"\n\s*(?:local)?rule ", r.stdout + r.stderr)
    assert r.returncode == 0 and not any(conv in j.split("\n")[1] for j in jobs if j.startswith("baseline"))
    # Table 1 from released drafters on a paper preset (a server preset) regenerates nothing
    released = "{released_checkpoints: {eagle3: a/e, dflash: a/f, dspark: a/s}}"
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "8", "--config", "preset=qwen3-4b", f"eval={released}")
    assert r.returncode == 0 and "baseline" in r.stdout and "regenerate" not in r.stdout, (r.stdout + r.stderr)[-3000:]
    # a GPU server claims its GPUs inside the exec'd command (claim-gpus then execs vLLM: the same pid)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "16", "--config", "preset=qwen3-4b")
    assert r.returncode == 0 and "; exec python -m deepspec claim-gpus 8 -- vllm serve " in r.stdout + r.stderr


def test_regeneration_server_is_started_and_stopped_by_the_dag(tmp_path, shared_data):
    """The tiny preset regenerates through `deepspec serve` started by the
    regenerate_server rule: the shards wait for it, it answers every request,
    Snakemake terminates it once they are done, and nothing listens afterwards."""
    import socket

    copy_workflow(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DEEPSPEC_DATA=str(shared_data), HF_HUB_OFFLINE="1")
    conv = tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl"
    r = snakemake(tmp_path, str(conv.relative_to(tmp_path)), "--cores", "3", "--config", "preset=tiny",
                   _server_config(port), env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Terminating service job" in out
    log = (tmp_path / "logs" / "tiny" / "regenerate_server.log").read_text()
    recs = [json.loads(l) for l in conv.read_text().splitlines()]
    turns = sum(sum(m["role"] == "assistant" for m in rec["messages"]) for rec in recs)
    assert len(recs) == 12 and turns >= 12
    assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') == turns and f"stopped after {turns} requests" in log
    for i in range(2):
        assert "server(s) up after" in (tmp_path / "logs" / "tiny" / f"regenerate_{i}.log").read_text()
    assert not (conv.parent / "server.pid").exists() and not (conv.parent / "server.service").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the server is gone


@pytest.mark.parametrize("regen, says", [
    ("{backend: server, server: {command: 'serve {modl}'}}", "cannot fill in 'modl'"),
    ("{backend: local, server: {command: 'serve {model}'}}", "regenerate.server is set but regenerate.backend is 'local'"),
])
def test_bad_regeneration_server_stops_the_plan(tmp_path, regen, says):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", "--cores", "3", "--config", "preset=tiny", f"regenerate={regen}")
    assert r.returncode != 0 and says in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]

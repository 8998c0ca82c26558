"""The end-to-end tier: whole DAGs run by snakemake (python -m pytest -m e2e): the tiny
preset end to end, a SIGTERM to training, and the regeneration server the DAG starts and stops."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from deepspec.reporting.report import FIG2_COLUMNS, FIG2_RB_COLUMNS, TABLE1_COLUMNS

from helpers import copy_workflow, shell_commands, snakemake

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


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
    from deepspec.runtime import resolve_precision

    bf16 = resolve_precision("auto", "cpu", stage="train") == "bfloat16"  # this CPU multiplies bf16 natively
    for method, d in prov["drafters"].items():
        assert d["training"]["mixed_precision"] == ("bf16" if bf16 else "no"), method
        assert d["training"]["code"]["commit"] == head, method
        assert [(e["device"], e["target_dtype"], e["drafter_dtype"]) for e in d["evaluation"]] == [
            ("cpu", *2 * ["bfloat16" if bf16 else "float32"])], method
    assert prov["precision"]["cache"]["recorded"] == ["bfloat16" if bf16 else "float32"]
    assert "## Provenance" in (tmp_path / "results" / "REPORT.md").read_text()
    # snakemake --report: the run's figures and tables with their captions (workflow/report/)
    rep = snakemake(tmp_path, "figures/fig2.pdf", "--report", "report.html", "--config", "preset=tiny", env=env)
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:]
    html = (tmp_path / "report.html").read_text()
    assert "suffix decay" in html and "Table 1: mean accepted length" in html
    # A rerun has nothing to do.
    r2 = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny", env=env)
    assert "Nothing to be done" in r2.stdout + r2.stderr
    # A changed setting reruns exactly the rules that depend on it, and their descendants.
    for override, want in CHANGES.items():
        assert _planned(tmp_path, env, override) == want, override
    # Seeded: the cache, training, evaluation and report made again give Figure 2's table byte for byte.
    fig2 = (tmp_path / "results" / "tables" / "fig2.csv").read_bytes()
    r3 = snakemake(tmp_path, "figures/fig2.pdf", "--cores", "2", "--config", "preset=tiny", "--forcerun", "build_cache",
                   env=env, timeout=900)
    assert r3.returncode == 0, r3.stdout[-3000:] + r3.stderr[-3000:]
    assert "build_cache" in r3.stdout + r3.stderr
    assert (tmp_path / "results" / "tables" / "fig2.csv").read_bytes() == fig2


EVAL = {"evaluate": 3, "report": 1}  # one evaluate job per method (all benchmarks)


CHANGES = {  # tiny preset: 3 drafters, 3 benchmarks
    "eval={max_new_tokens: 12}": {"baseline": 2, **EVAL},  # eval.baseline_jobs: 2
    "regenerate={temperature: 0.5}": {"regenerate_shard": 2, "regenerate": 1, "tokenize": 1, "build_cache": 1,
                                      "train": 3, **EVAL},
    "data={min_loss_tokens: 2}": {"tokenize": 1, "build_cache": 1, "train": 3, **EVAL},
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


def test_sigterm_to_the_train_job_writes_a_checkpoint(tmp_path):
    """NR2: SIGTERM to a train job's shell (what Snakemake holds, and what SLURM's
    warning ahead of the time limit reaches first) reaches the trainer, which the shell
    exec's: the job ends only after the trainer wrote its checkpoint and stopped, so
    the rerun resumes from it. (A shell that stayed the trainer's parent died at once,
    with no checkpoint written, leaving the trainer to be killed by the job's cleanup.)
    The command is the train rule's, as `snakemake -p` prints it, run as Snakemake
    runs it (bash, `set -euo pipefail`)."""
    from helpers import write_conversations

    copy_workflow(tmp_path)
    drafter = Path("results/tiny/drafters/dspark")
    r = snakemake(tmp_path, str(drafter / "config.json"), "-n", "-p", "--cores", "1", "--config", "preset=tiny",
                  "cache={mode: online}", "train={epochs: 1000, global_batch: 2, checkpoint_every: 1000000}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    cmd = [c for c in shell_commands(out) if "-m deepspec train" in c]
    assert len(cmd) == 1 and cmd[0].startswith("exec "), cmd
    write_conversations(tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl")
    (tmp_path / "logs" / "tiny").mkdir(parents=True)
    log, ckpts = tmp_path / "logs" / "tiny" / "train_dspark.log", tmp_path / drafter / "checkpoints"
    job = subprocess.Popen(["bash", "-c", "set -euo pipefail; " + cmd[0]], cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / drafter / "train_log.csv").exists():  # written after the first step
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        rc = job.wait(timeout=240)
        text = log.read_text()
        latest = (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists() else None
        assert rc != 0 and latest and (ckpts / latest).is_dir(), (rc, latest, text[-3000:])
        assert f"stopped by SIGTERM after step {latest[5:]}/" in text and "rerun to resume" in text, text[-3000:]
        assert not (tmp_path / drafter / "config.json").exists()  # stopped, not finished
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # whatever the job left running
        except ProcessLookupError:
            pass


def _server_config(port) -> str:
    """regenerate.server with deepspec serve on `port` (None: chosen at run time)."""
    return ("regenerate={backend: server, server: {command: 'python -m deepspec serve {model} --host {host} "
            f"--port {{port}} --served-model-name {{name}} --max-tokens 64', port: {'null' if port is None else port}, "
            "threads: 1}}")


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
    # the server runs under run-server (its own process group, the port checked, a status with this run's
    # token), and the shards take the same token
    run = re.search(r"exec python -m deepspec run-server --status results/tiny/regen/server.json --token (\w+) "
                    r"--host 127.0.0.1 --port 30999 --gpus 0 --log logs/tiny/regenerate_server.log "
                    r"'python -m deepspec serve resources/targets/tiny --host 127.0.0.1 --port 30999 ", out)
    assert run, out[-3000:]
    assert out.count(f"--server-token {run.group(1)} ") == 2
    jobs = re.split(r"\n\s*(?:local)?rule ", out)
    for name, n in (("baseline:", 2), ("evaluate:", 3)):
        blocks = [j for j in jobs if j.startswith(name)]
        assert len(blocks) == n and all(conv in j.split("\n")[1] for j in blocks), name
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny")
    jobs = re.split(r"\n\s*(?:local)?rule ", r.stdout + r.stderr)
    assert r.returncode == 0 and not any(conv in j.split("\n")[1] for j in jobs if j.startswith("baseline"))
    # Table 1 from released drafters on a paper preset (a server preset) regenerates nothing
    released = "{released_checkpoints: {eagle3: a/e, dflash: a/f, dspark: a/s}}"
    for d in ("e", "f", "s"):  # planning checks a local checkpoint exists (converted when evaluated)
        (tmp_path / "a" / d).mkdir(parents=True)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "8", "--config", "preset=qwen3-4b", f"eval={released}")
    assert r.returncode == 0 and "baseline" in r.stdout and "regenerate" not in r.stdout, (r.stdout + r.stderr)[-3000:]
    # a GPU server: run-server claims its 8 GPUs and picks the port when it starts (qwen3-4b: port null)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "16", "--config", "preset=qwen3-4b")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"; exec python -m deepspec run-server .* --port auto --gpus 8 .* "
                                           r"--engine vllm '(vllm|(env PATH=\S+ )?\S+ -m vllm.entrypoints.cli.main) serve .*--port \{port\} ", out), out[-3000:]


def test_regeneration_server_is_started_and_stopped_by_the_dag(tmp_path, shared_data):
    """The tiny preset regenerates through `deepspec serve` started by the
    regenerate_server rule on a port chosen when it starts (port null): the
    shards wait for it, it answers every request, Snakemake terminates it once
    they are done, and nothing listens or runs afterwards."""
    import socket

    copy_workflow(tmp_path)
    env = dict(os.environ, DEEPSPEC_DATA=str(shared_data), HF_HUB_OFFLINE="1")
    conv = tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl"
    r = snakemake(tmp_path, str(conv.relative_to(tmp_path)), "--cores", "3", "--config", "preset=tiny",
                   _server_config(None), env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Terminating service job" in out
    log = (tmp_path / "logs" / "tiny" / "regenerate_server.log").read_text()
    port = int(re.search(r"starting the regeneration server on port (\d+)", log).group(1))
    recs = [json.loads(l) for l in conv.read_text().splitlines()]
    turns = sum(sum(m["role"] == "assistant" for m in rec["messages"]) for rec in recs)
    assert len(recs) == 12 and turns >= 12
    assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') == turns and f"stopped after {turns} requests" in log
    assert "stopped by SIGTERM; the server's process group is gone" in log
    for i in range(2):
        assert "this run's regeneration server is ready" in (tmp_path / "logs" / "tiny" / f"regenerate_{i}.log").read_text()
    assert not (conv.parent / "server.json").exists() and not (conv.parent / "server.service").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the server is gone
    assert not _processes_under(tmp_path)
    # each snakemake has a run token of its own, but the shards' command text does not change with it
    r = snakemake(tmp_path, str(conv.relative_to(tmp_path)), "-n", "--cores", "3", "--config", "preset=tiny",
                   _server_config(None), env=env)
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


def _processes_under(path) -> list[str]:
    """Command lines of the running processes whose working directory is `path`
    (Snakemake's jobs run there): what a run left behind."""
    left = []
    for d in os.listdir("/proc"):
        try:
            cwd = os.readlink(f"/proc/{d}/cwd")
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if cwd == str(path) and state != "Z":
            left.append(cmd)
    return left


# A stale server of the same served name on the port (R2): it counts the chat requests it gets.
STALE = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        b = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_POST(self):
        open(sys.argv[2], "a").write("POST\n")
        b = json.dumps({"choices": [{"message": {"content": "stale"}, "finish_reason": "stop"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_stale_server_on_the_port_is_never_used(tmp_path, shared_data):
    """R2/R5: a stale server of the same served name holds the preset's port (an
    earlier run's, after a SIGKILL of snakemake). The DAG's own server cannot have
    that port: the run fails in one line naming it, within seconds (not after
    health_timeout_s), no request reaches the stale server, nothing is regenerated
    and nothing of the run is left running."""
    import socket
    import subprocess
    import time

    copy_workflow(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "stale.py").write_text(STALE)
    posts = tmp_path / "posts.txt"
    stale = subprocess.Popen([sys.executable, str(tmp_path / "stale.py"), str(port), str(posts)])
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        env = dict(os.environ, DEEPSPEC_DATA=str(shared_data), HF_HUB_OFFLINE="1")
        conv = tmp_path / "results" / "tiny" / "regen" / "conversations.jsonl"
        t0 = time.monotonic()
        r = snakemake(tmp_path, str(conv.relative_to(tmp_path)), "--cores", "3", "--config", "preset=tiny",
                       _server_config(port), env=env, timeout=300)
        wall = time.monotonic() - t0
        out = r.stdout + r.stderr
        assert r.returncode != 0 and wall < 120, (wall, out[-3000:])
        says = f"port {port} on 127.0.0.1 is already in use"
        for i in range(2):
            shard = (tmp_path / "logs" / "tiny" / f"regenerate_{i}.log").read_text()
            errors = [l for l in shard.splitlines() if "error" in l]
            assert len(errors) == 1 and says in errors[0], shard[-2000:]
        assert says in (tmp_path / "logs" / "tiny" / "regenerate_server.log").read_text()
        assert not posts.exists() and not conv.exists()
        assert stale.poll() is None and not _processes_under(tmp_path)
    finally:
        stale.kill()
        stale.wait()

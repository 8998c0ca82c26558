"""The DAG itself: the tiny preset end to end, and dry runs of every preset."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from deepspec.config import PRESETS_DIR, load_config
from deepspec.reporting.report import FIG2_COLUMNS, FIG2_RB_COLUMNS, TABLE1_COLUMNS
from helpers import copy_workflow, local_rules, snakemake

REPO = Path(__file__).resolve().parents[1]






def _checkout_copy(dst: Path) -> Path:
    """A second checkout of this one, as a clone or a git worktree holds it: the
    Snakefile, the rules, the profiles, the presets and the package."""
    for name in ["workflow", "config", "profiles", "deepspec"]:
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "Snakefile", dst / "Snakefile")
    return dst


@pytest.mark.parametrize("installed", ["editable", "non-editable"])
def test_dag_plans_from_the_presets_of_its_own_checkout(tmp_path, installed):
    """W1-W4, N3: two checkouts share one environment, in which this one is installed
    (editable: its directory on sys.path, as `pip install -e .` puts it; non-editable:
    its package alone in a site-packages, without presets or schema, as `pip install .`
    copies it). A second checkout drops mt-bench from its tiny preset; `snakemake -n`
    there, started as the `snakemake` script starts it (sys.path not led by the working
    directory: python -P), plans from the second checkout's preset, not the installed one's."""
    site = REPO
    if installed == "non-editable":
        site = tmp_path / "site-packages"
        shutil.copytree(REPO / "deepspec", site / "deepspec", ignore=shutil.ignore_patterns("__pycache__"))
    second = _checkout_copy(tmp_path / "second")
    preset = second / "config" / "presets" / "tiny.yaml"
    text = preset.read_text()
    edited = text.replace("    mt-bench: {path: eval/mt-bench.jsonl, cap: 2, domain: Chat}\n", "").replace(
        "speed_benchmarks: [gsm8k, mt-bench]", "speed_benchmarks: [gsm8k]")
    assert edited.count("mt-bench") == 0 < text.count("mt-bench")
    preset.write_text(edited)
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-P", "-m", "snakemake", "-n", "--cores", "2", "figures/fig2.pdf",
                        "--config", "preset=tiny"], cwd=second, capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "eval/gsm8k.jsonl" in out and "mt-bench" not in out, out[-3000:]


def test_checkout_refuses_another_package(tmp_path):
    """The DAG's checkout check (deepspec/checkout.py): a package imported from another
    checkout, or a working directory whose deepspec/ (which the jobs' `python -m deepspec`
    would import) is another one, is refused in one line naming both; the jobs get the
    checkout first on PYTHONPATH."""
    from deepspec.checkout import PACKAGE_DIR, enter
    from deepspec.errors import DeepSpecError

    other = tmp_path / "other"
    (other / "deepspec").mkdir(parents=True)
    (other / "deepspec" / "__init__.py").write_text("")
    with pytest.raises(DeepSpecError, match="would run the deepspec package of") as e:
        enter(other, cwd=other, environ={})
    assert str(other) in str(e.value) and str(PACKAGE_DIR.parent) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DeepSpecError, match="the jobs would run the deepspec package of the working directory") as e:
        enter(PACKAGE_DIR.parent, cwd=other, environ={})
    assert str(other) in str(e.value) and str(PACKAGE_DIR.parent) in str(e.value)
    environ = {"PYTHONPATH": os.pathsep.join(["/elsewhere", str(PACKAGE_DIR.parent)])}
    enter(PACKAGE_DIR.parent, cwd=tmp_path, environ=environ)
    assert environ["PYTHONPATH"] == os.pathsep.join([str(PACKAGE_DIR.parent), "/elsewhere"])
    # a Snakefile without the package beside it (the DAG copied out of its checkout)
    copy_workflow(tmp_path / "bare")
    (tmp_path / "bare" / "deepspec").unlink()
    r = snakemake(tmp_path / "bare", "-n", "--cores", "1", "--config", "preset=tiny")
    assert r.returncode != 0 and "has no deepspec/ package beside its Snakefile" in r.stdout + r.stderr


def test_non_editable_install_says_it_needs_a_checkout(tmp_path):
    """N2: the package alone (what a non-editable `pip install .` puts in site-packages)
    has no presets or schema: one line saying that DeepSpec runs from its checkout with
    `pip install -e .`, for a preset name and for a preset file alike."""
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "deepspec", site / "deepspec", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(site))
    for preset in ["tiny", str(REPO / "config" / "presets" / "tiny.yaml")]:
        r = subprocess.run([sys.executable, "-P", "-m", "deepspec", "show-config", "--preset", preset],
                           cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "is not inside a DeepSpec checkout" in r.stderr and "pip install -e ." in r.stderr, r.stderr


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_dry_run_plans_every_preset(tmp_path, preset):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "1", "--config", f"preset={preset}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    for rule in ["prepare_target", "regenerate", "train", "evaluate", "baseline", "report"]:
        assert rule in out, f"{rule} missing from the plan of {preset}"


def _job_priorities(out: str) -> dict:
    """{(rule, method or part): priority} of a dry run's job blocks (0 where none is printed)."""
    prio = {}
    for block in re.split(r"\n(?=\[|localrule |rule )", out):
        m = re.match(r"(?:local)?rule (\w+):", block.lstrip("\n"))
        if m:
            w = re.search(r"wildcards: (?:method|part)=(\w+)", block)
            p = re.search(r"priority: (\d+)", block)
            prio[(m.group(1), w.group(1) if w else None)] = int(p.group(1)) if p else 0
    return prio


def test_train_start_first_orders_training_jobs(tmp_path):
    """The trainers come first (10, train.start_first's methods above the others in its
    order), then the evaluations (1, start_first's in its order: the longest training's
    evaluation ends the run), then the baselines (0: only the report reads them); a name
    that is no method of the preset stops the plan."""
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "2", "--config", "preset=tiny",
                   "train={start_first: [dspark, eagle3]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    prio = _job_priorities(r.stdout + r.stderr)
    assert {k[1]: v for k, v in prio.items() if k[0] == "train"} == {"dspark": 12, "eagle3": 11, "dflash": 10}, prio
    assert {k[1]: v for k, v in prio.items() if k[0] == "evaluate"} == {"dspark": 3, "eagle3": 2, "dflash": 1}, prio
    assert {v for k, v in prio.items() if k[0] == "baseline"} == {0}, prio
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


@pytest.mark.e2e
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
    from deepspec.runtime import resolve_precision

    bf16 = resolve_precision("auto", "cpu", stage="train") == "bfloat16"  # this CPU multiplies bf16 natively
    for method, d in prov["drafters"].items():
        assert d["training"]["mixed_precision"] == ("bf16" if bf16 else "no"), method
        assert d["training"]["code"]["commit"] == head, method
        assert [(e["device"], e["target_dtype"], e["drafter_dtype"]) for e in d["evaluation"]] == [
            ("cpu", *2 * ["bfloat16" if bf16 else "float32"])], method
    assert prov["precision"]["cache"]["recorded"] == ["bfloat16" if bf16 else "float32"]
    assert "## Provenance" in (tmp_path / "results" / "REPORT.md").read_text()
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
    # exec'd (a SIGTERM reaches srun); the task count and each node's CPUs (resources.train.threads) named
    assert len(train) == 1 and train[0].startswith("exec env ") and (
        "srun --overlap --nodes 2 --ntasks 2 --ntasks-per-node 1 --cpus-per-task 32 --gpus-per-node 8 " in train[0])
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
    prof = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    prof.pop("executor")
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "config.yaml").write_text(yaml.safe_dump(prof))
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--profile", "prof", "--config", "preset=qwen3-4b")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = re.findall(r"rule (\w+):\n(?:    .*\n)*?    resources: (.*)", r.stdout + r.stderr)
    signalled = sorted({name for name, res in jobs if "slurm_extra=--signal=TERM@900" in res})
    assert signalled == ["train"], jobs[:3]


@pytest.mark.e2e
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
    cmd = [c for c in _shell_commands(out) if "-m deepspec train" in c]
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


def test_slurm_jobs_ask_for_the_threads_of_their_preset(tmp_path):
    """NR3: SLURM jobs get the CPUs their preset asks for (resources.<rule>.threads),
    whatever the cores of the machine Snakemake runs on: each rule declares them as
    cpus_per_task, which the SLURM executor requests as it is, and the workflow profile
    (loaded beside --profile profiles/slurm) sets no cores. Planned on this small
    machine with the SLURM profile minus its executor, and with --cores 2 given."""
    import yaml

    assert "cores" not in yaml.safe_load((REPO / "profiles/default/config.yaml").read_text())
    copy_workflow(tmp_path)
    prof = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    prof.pop("executor")
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "config.yaml").write_text(yaml.safe_dump(prof))
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--profile", "prof", "--cores", "2", "--config", "preset=qwen3-4b")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Using profiles prof and workflow specific profile profiles/default" in out
    cfg = load_config("qwen3-4b")
    want = {"train": cfg["resources"]["train"]["threads"], "evaluate": cfg["resources"]["evaluate"]["threads"],
            "baseline": cfg["resources"]["evaluate"]["threads"], "regenerate_server": cfg["regenerate"]["server"]["threads"],
            "regenerate_shard": 0}  # beside the server a shard only sends requests
    assert want["train"] > 2 and want["regenerate_server"] > 2
    got = {}
    for block in re.split(r"\n\s*(?:local)?rule ", out)[1:]:
        name = block.split(":", 1)[0]
        if name in want:
            got.setdefault(name, set()).update(int(c) for c in re.findall(r"cpus_per_task=(\d+)", block.split("Shell command")[0]))
    assert got == {k: {v} for k, v in want.items()}, got


def _server_config(port) -> str:
    """regenerate.server with deepspec serve on `port` (None: chosen at run time)."""
    return ("regenerate={backend: server, server: {command: 'python -m deepspec serve {model} --host {host} "
            f"--port {{port}} --served-model-name {{name}} --max-tokens 64', port: {'null' if port is None else port}, "
            "threads: 1}}")


@pytest.mark.e2e
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
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "--cores", "8", "--config", "preset=qwen3-4b", f"eval={released}")
    assert r.returncode == 0 and "baseline" in r.stdout and "regenerate" not in r.stdout, (r.stdout + r.stderr)[-3000:]
    # a GPU server: run-server claims its 8 GPUs and picks the port when it starts (qwen3-4b: port null)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "16", "--config", "preset=qwen3-4b")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"; exec python -m deepspec run-server .* --port auto --gpus 8 .* "
                                           r"--engine vllm '(vllm|(env PATH=\S+ )?\S+ -m vllm.entrypoints.cli.main) serve .*--port \{port\} ", out), out[-3000:]


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_stale_server_on_the_port_is_never_used(tmp_path, shared_data):
    """R2/R5: a stale server of the same served name holds the preset's port (an
    earlier run's, after a SIGKILL of snakemake). The DAG's own server cannot have
    that port: the run fails in one line naming it, within seconds (not after
    health_timeout_s), no request reaches the stale server, nothing is regenerated
    and nothing of the run is left running."""
    import socket
    import subprocess
    import sys
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


@pytest.mark.parametrize("regen, says", [
    ("{backend: server, server: {command: 'serve {modl}'}}", "cannot fill in 'modl'"),
    ("{backend: local, server: {command: 'serve {model}'}}", "regenerate.server is set but regenerate.backend is 'local'"),
])
def test_bad_regeneration_server_stops_the_plan(tmp_path, regen, says):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", "--cores", "3", "--config", "preset=tiny", f"regenerate={regen}")
    assert r.returncode != 0 and says in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]

"""The DAG itself: the tiny preset end to end, and dry runs of every preset."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec.config import PRESETS_DIR, load_config

from helpers import copy_workflow, local_rules, shell_commands, snakemake

REPO = Path(__file__).resolve().parents[1]


def _checkout_copy(dst: Path) -> Path:
    """A second checkout of this one, as a clone or a git worktree holds it: the
    Snakefile, the rules, the profiles, the presets and the package."""
    for name in ["workflow", "config", "profiles", "deepspec"]:
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ["Snakefile", "environment.yml"]:
        shutil.copy(REPO / name, dst / name)
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


def test_a_run_with_its_own_results_dir_keeps_its_own_logs(tmp_path):
    """The README's second run of the default (fp32 forced) goes to results/fp32;
    its logs go to logs/fp32, so its jobs do not overwrite the first run's logs."""
    cmds = [c for c in _readme_snakemake_commands() if any(a.startswith("results_dir=") for a in c)]
    assert cmds, "the README shows no run with its own results_dir"
    for cmd in cmds:
        assert any(a.startswith("logs_dir=") for a in cmd), " ".join(cmd)
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fp32/fig2.pdf", "-n", "--cores", "1", "--config", "preset=tiny",
                  "results_dir=results/fp32", "figures_dir=figures/fp32", "logs_dir=logs/fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    logs = re.findall(r"^\s+log: (\S+)", r.stdout, flags=re.M)
    assert logs and all(p.startswith("logs/fp32/tiny/") for p in logs), logs


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-4b"])  # the CPU default; a GPU preset with its server rule
def test_snakemake_lint_is_clean(tmp_path, preset):
    """`snakemake --lint` finds nothing: every rule names its environment, takes its
    values through input, output, params or resources, and no rule file mixes rules
    and functions. It needs no prompt data (a fresh clone, before prepare-data)."""
    copy_workflow(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DEEPSPEC_DATA"}
    r = snakemake(tmp_path, "--lint", "--config", f"preset={preset}", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Congratulations, your workflow is in a good condition" in out, out[-3000:]


def test_bad_config_key_stops_the_run(tmp_path):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", "--cores", "1", "--config", "preset=tiny", "trian={epochs: 1}")
    assert r.returncode != 0 and "unknown key 'trian'" in (r.stdout + r.stderr)


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
    cmds = shell_commands(out)
    assert any(re.search(r"--shard 0/1 --server-token \w+ --out results/tiny/regen/shards/conversations.0-of-1.jsonl", c)
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


def test_gpu_jobs_claim_their_own_gpus(tmp_path):
    """On one machine each GPU job takes GPU ids no other job holds (claim-gpus),
    instead of every evaluation landing on GPU 0; GPU training grows its memory in
    expandable segments; local regeneration shards take a GPU each."""
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "figures/fig2.pdf", "-n", "-p", "--cores", "1", "--config", "preset=qwen3-4b",
                   "regenerate={backend: local, shards: 2, server: null}", "resources={regenerate: {gpu: 1}}", "cache={mode: offline}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cmds = shell_commands(r.stdout + r.stderr)
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
    train = [c for c in shell_commands(out) if "deepspec train" in c]
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


@pytest.mark.parametrize("regen, says", [
    ("{backend: server, server: {command: 'serve {modl}'}}", "cannot fill in 'modl'"),
    ("{backend: local, server: {command: 'serve {model}'}}", "regenerate.server is set but regenerate.backend is 'local'"),
])
def test_bad_regeneration_server_stops_the_plan(tmp_path, regen, says):
    copy_workflow(tmp_path)
    r = snakemake(tmp_path, "-n", "--cores", "3", "--config", "preset=tiny", f"regenerate={regen}")
    assert r.returncode != 0 and says in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]

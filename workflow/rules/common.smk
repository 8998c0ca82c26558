# Shared setup: load and validate the preset, the path layout (deepspec/paths.py,
# the same one the commands use), wildcard constraints, input functions, the
# globals more than one rule file reads, the config arguments every rule passes
# to `python -m deepspec` ({resources.config_args} in its shell command) and, as
# params.settings, the fingerprint of exactly the settings the rule depends on
# (deepspec.config.RULE_SETTINGS): Snakemake's params trigger then reruns the
# rules whose settings changed, and only those.
#
# The preset is validated by deepspec.config.load_config against
# workflow/schemas/config.schema.yaml (not snakemake.utils.validate): the
# commands run outside Snakemake validate the same way, presets and --set
# overrides included.
import json
import re
import shlex
import sys
import uuid
import zlib
from pathlib import Path

# The DAG runs the code, presets and schema of the checkout it lives in, also when
# another checkout is installed in the same environment (a git worktree, a second
# clone): the checkout goes first on sys.path before anything imports deepspec,
# and deepspec.checkout.enter checks that Snakemake and every job import it.
CHECKOUT = Path(workflow.basedir).resolve()
if not (CHECKOUT / "deepspec" / "__init__.py").is_file():
    raise WorkflowError(f"{CHECKOUT} has no deepspec/ package beside its Snakefile: run the DAG from a "
                        "DeepSpec checkout (git clone, then pip install -e .)")
sys.path.insert(0, str(CHECKOUT))
try:
    from deepspec.workflow import (SOURCE_FILE, DeepSpecError, RunPaths, check_sources, coerce_overrides, data_root,
                                   enter_checkout, fig3_methods, fig4_methods, gpu_env, hub_datasets, is_prompt_file,
                                   load_config, needed_files, preflight, released_hub, server_command, settings_fingerprint,
                                   Settings, snapshot_name, speed_benchmarks, train_launcher)

    enter_checkout(CHECKOUT)
except ImportError as e:  # another deepspec, older than this one, was imported first
    raise WorkflowError(f"checkout error: cannot import deepspec.workflow of {CHECKOUT} ({e})")
except DeepSpecError as e:
    raise WorkflowError(f"checkout error: {e}")

PRESET = str(config.get("preset", "smollm2-135m"))
# --config passes `train={epochs: 2}` or `x=true` as text: read it as YAML 1.2
_OVERRIDES = coerce_overrides({k: v for k, v in config.items() if k != "preset"})
try:
    CFG = load_config(PRESET, _OVERRIDES)
    S = Settings.of(CFG)  # its typed sections: S.train.methods, S.eval.gpus, ...
except DeepSpecError as e:
    raise WorkflowError(f"config error: {e}")


def _flatten(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flatten(v, f"{key}.")
        else:
            yield key, v


# Passed to every deepspec command so it sees the same config, as the rule's
# resources.config_args: a string resource, not a param, because a rule's
# resources are no rerun trigger, so a change of the overrides reruns a rule only
# through its params.settings (and not a global in the shell command, which
# `snakemake --lint` refuses).
CONFIG_ARGS = " ".join(
    [f"--preset {shlex.quote(PRESET)}"]
    + [f"--set {shlex.quote(f'{k}={json.dumps(v)}')}" for k, v in _flatten(_OVERRIDES)]
)

PATHS = RunPaths.of(S)  # this preset's files (given wildcards such as "{method}": rule patterns)
METHODS = list(S.train.methods)
FIG3_METHODS = fig3_methods(S)
FIG4_METHODS = fig4_methods(S)
ALL_METHODS = list(dict.fromkeys(METHODS + FIG3_METHODS + FIG4_METHODS))
for _m in S.train.start_first:
    if _m not in ALL_METHODS:
        raise DeepSpecError(f"train.start_first: '{_m}' is none of this preset's methods ({', '.join(ALL_METHODS)})")
BENCHMARKS = list(S.data.benchmarks)
# The prompt files the preset reads, under data.root (DEEPSPEC_DATA overrides);
# prepare_data builds the missing ones. A missing file without a known source
# stops the plan here.
DATA_ROOT = data_root(S)
DATA_FILES = needed_files(S)
try:
    check_sources(S)
    preflight(S)  # every check that needs only the config and the file system
except DeepSpecError as e:
    raise WorkflowError(f"config error: {e}")


def _one_of(names):
    return "|".join(re.escape(n) for n in names)


wildcard_constraints:
    method=_one_of(ALL_METHODS),
    benchmark=_one_of(BENCHMARKS),


def settings(rule):
    """params.settings of a rule: the fingerprint of the settings it depends on."""
    return settings_fingerprint(S, rule)


def res(rule, key, default):
    """Per-rule scheduler resources from the preset (resources.<rule>.<key>).
    A rule's threads (resources.<rule>.threads) are also its resources'
    cpus_per_task: Snakemake caps `threads` at the --cores of the machine it runs
    on, even for SLURM jobs, while the SLURM executor asks for cpus_per_task as
    it is (profiles/slurm)."""
    return S.resources.get(rule, {}).get(key, default)



# gpu_env(n) (deepspec/gpus.py): the prefix of a GPU rule's command that
# gives the job n GPU ids of its own (Snakemake hands out none on a local machine;
# inside a SLURM job it picks among the ids SLURM set); "" for n = 0.


# ---------------------------------------------------------------- shared inputs

TARGET_CONFIG = PATHS.target_checkpoint() / "config.json"  # the prepared target (prepare_target)
# Hub snapshots at the preset's pinned revisions, fetched by the local rules fetch_dataset and
# fetch_released (prepare_data.smk; deepspec/fetch.py): {snapshot name: (hub id, revision)}; each
# is ready once its record (deepspec_source.json, written last) exists.
HUB_DATASETS = hub_datasets(S)  # data.train's hub: sources
RELEASED_HUB = {snapshot_name(*v): v for v in released_hub(S).values()}  # eval.released_checkpoints {hub, revision}


def hub_record(kind, name):
    return PATHS.hub_snapshot(kind, name) / SOURCE_FILE


# the training prompt files on disk, and the snapshots of the hub: sources
TRAIN_PROMPT_FILES = [DATA_ROOT / e["path"] for e in S.data.train if is_prompt_file(e["path"])] + \
    [hub_record("datasets", name) for name in HUB_DATASETS]


def released_input(method):
    """{"released": the fetched snapshot's record} for a method evaluated from a released hub checkpoint."""
    v = S.eval.released_checkpoints.get(method)
    return {"released": hub_record("models", snapshot_name(v["hub"], v["revision"]))} if isinstance(v, dict) else {}

# the benchmarks with a batch-1 timed sample, and so a baseline (eval.speed_benchmarks)
SPEED_BENCHMARKS = speed_benchmarks(S)
# the benchmark prompt files on disk (a hub: benchmark is read from the hub)
BENCHMARK_FILES = [DATA_ROOT / f for f in (S.data.benchmarks[b]["path"] for b in BENCHMARKS)
                   if is_prompt_file(f)]
# The baselines of the timed benchmarks run in eval.baseline_jobs jobs (evaluate.smk),
# job I timing every N-th of them from the I-th.
BASELINE_JOBS = min(S.eval.baseline_jobs, len(SPEED_BENCHMARKS))
BASELINES = [PATHS.baseline_part(i, BASELINE_JOBS) for i in range(BASELINE_JOBS)]
# Paper Figure 6 uses Alpaca; a preset without it falls back to its first Chat benchmark
# (the calibration of ablations.smk, which throughput.smk's Algorithm 1 reads).
FIG6_BENCHMARK = S.ablations.calibration_benchmark
if FIG6_BENCHMARK not in BENCHMARKS:
    FIG6_BENCHMARK = next((b for b in BENCHMARKS if S.data.benchmarks[b]["domain"] == "Chat"), BENCHMARKS[0])

REGEN_SERVER = S.regenerate.server
# The merged conversations, for the GPU jobs that must not start beside a
# running regeneration server (baseline, evaluate of released checkpoints,
# throughput; regenerate.smk): nothing without regenerate.server or when every
# method of train.methods is a released checkpoint (Table 1 from the released
# drafters needs no regeneration; the ablations' extra methods do not count).
_TRAINED = [m for m in METHODS if m not in S.eval.released_checkpoints]
REGENERATION_DONE = [PATHS.conversations()] if REGEN_SERVER and _TRAINED else []

# The evaluation jobs (evaluate, baseline, schedule, throughput): on GPU presets
# each takes a GPU no other job holds (gpu_env: claim-gpus).
EVAL_GPUS = S.eval.gpus
EVAL_ENV = gpu_env(min(EVAL_GPUS, 1))
EVAL_RESOURCES = dict(
    cpus_per_task=res("evaluate", "threads", 2),
    mem_mb=res("evaluate", "mem_mb", 4000),
    runtime=res("evaluate", "runtime", 120),
    gpu=res("evaluate", "gpu", EVAL_GPUS),
)


# ---------------------------------------------------------------- input functions


def train_data(wc):
    """The cache manifest, or with cache.mode: online the conversations themselves
    (and their token arrays, the tokenize rule's)."""
    if S.cache.mode == "online":
        return [PATHS.conversations(), PATHS.tokens_record()]
    return PATHS.cache_dir() / "manifest.json"


# The baselines wait for the training data (the cores go to the data, then to the
# trainers and evaluations, and the baselines fill what is left): an ordering only,
# `ancient` so that new training data never reruns them, and none where nothing is trained.
_data = train_data(None)
BASELINE_AFTER = [ancient(f) for f in (_data if isinstance(_data, list) else [_data])] if _TRAINED else []


def _first_rank(method) -> int:
    """len(train.start_first) for its first method down to 1 for its last; 0 for the others."""
    first = S.train.start_first
    return len(first) - first.index(method) if method in first else 0


def train_priority(wc):
    """10 for every training job (above the evaluations and the baselines' 0: the
    trainers are the critical path), more for train.start_first's methods (the first highest)."""
    return 10 + _first_rank(wc.method)


def eval_priority(wc):
    """1 for every evaluation (after the trainers, before the baselines), more for
    train.start_first's methods in its order: the first starts with the longest training
    and finishes last, so its evaluation ends the run and takes the first free core."""
    return 1 + _first_rank(wc.method)


def train_port(wc):
    """Each method its own rendezvous port (parallel trainers on one machine do
    not collide): train.main_process_port + crc32(method) % 1000."""
    return S.train.main_process_port + zlib.crc32(wc.method.encode()) % 1000



def eval_inputs(wc):
    """evaluate's inputs (one job per method, every benchmark; it times plain
    decoding itself, beside each timed prompt, so it needs no baseline). A method with a
    released checkpoint (eval.released_checkpoints) is evaluated from the hub
    and needs no trained drafter."""
    inputs = {"target": TARGET_CONFIG, "prompts": BENCHMARK_FILES}
    if wc.method not in S.eval.released_checkpoints:
        inputs["drafter"] = PATHS.drafter_dir(wc.method) / "config.json"
    return {**inputs, **released_input(wc.method)}


def all_records(methods):
    return [PATHS.records(m, b) for m in methods for b in BENCHMARKS]


# ---------------------------------------------------------------- the rule files' input functions


def regen_server_input(wc):
    return {"server": PATHS.server_service()} if REGEN_SERVER else {}


def baseline_args(wc):
    benches = SPEED_BENCHMARKS[int(wc.part) :: BASELINE_JOBS]
    return " ".join(f"--benchmark {shlex.quote(b)}" for b in benches)


THROUGHPUT_METHOD = S.throughput.method


def throughput_inputs(wc):
    """The target, the benchmarks' prompts and the drafter (trained, unless it is a released checkpoint)."""
    inputs = {"target": TARGET_CONFIG, "prompts": BENCHMARK_FILES,
              "regenerated": REGENERATION_DONE}  # no GPU job beside the regeneration server
    if THROUGHPUT_METHOD not in S.eval.released_checkpoints:
        inputs["drafter"] = PATHS.drafter_dir(THROUGHPUT_METHOD) / "config.json"
    inputs.update(released_input(THROUGHPUT_METHOD))  # a released hub checkpoint's fetched snapshot
    if THROUGHPUT_METHOD == "dspark":  # Algorithm 1 on STS-calibrated confidences (the schedule rule's fit)
        inputs["sts"] = PATHS.schedule(FIG6_BENCHMARK, "alg1.json")
    return inputs


def sts_arg(wc, input):
    return f"--sts {shlex.quote(input.sts)}" if "sts" in input.keys() else ""

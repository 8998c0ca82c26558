# Shared setup: load and validate the preset, the path layout (deepspec/paths.py,
# the same one the commands use), wildcard constraints, input functions, the
# config arguments every rule passes to `python -m deepspec` ({CONFIG_ARGS} in
# its shell command) and, as params.settings, the fingerprint of exactly the
# settings the rule depends on (deepspec.config.RULE_SETTINGS): Snakemake's
# params trigger then reruns the rules whose settings changed, and only those.
import json
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir)))
from deepspec.config import coerce_overrides, load_config, settings_fingerprint
from deepspec.errors import DeepSpecError
from deepspec.paths import RunPaths
from deepspec.training.launch import gpu_env
from deepspec.training.launch import launcher as train_launcher
from deepspec.methods import fig3_methods, fig4_methods
from deepspec.planning.preflight import preflight
from deepspec.data.sources import check_sources, needed_files
from deepspec.data.prompts import data_root, speed_benchmarks

PRESET = str(config.get("preset", "smollm2-135m"))
# --config passes `train={epochs: 2}` or `x=true` as text: read it as YAML 1.2
_OVERRIDES = coerce_overrides({k: v for k, v in config.items() if k != "preset"})
try:
    CFG = load_config(PRESET, _OVERRIDES)
except DeepSpecError as e:
    raise WorkflowError(f"config error: {e}")


def _flatten(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flatten(v, key + ".")
        else:
            yield key, v


# Passed to every deepspec command so it sees the same config. A global, not a
# param: a change reruns a rule only through its params.settings.
CONFIG_ARGS = " ".join(
    [f"--preset {shlex.quote(PRESET)}"]
    + [f"--set {shlex.quote(k + '=' + json.dumps(v))}" for k, v in _flatten(_OVERRIDES)]
)

TARGET = CFG["target"]["name"]
PATHS = RunPaths.of(CFG)  # this preset's files
P = RunPaths.of(CFG, target="{target}")  # the same layout as rule patterns
METHODS = list(CFG["train"]["methods"])
FIG3_METHODS = fig3_methods(CFG)
FIG4_METHODS = fig4_methods(CFG)
ALL_METHODS = list(dict.fromkeys(METHODS + FIG3_METHODS + FIG4_METHODS))
for _m in CFG["train"]["start_first"]:
    if _m not in ALL_METHODS:
        raise DeepSpecError(f"train.start_first: '{_m}' is none of this preset's methods ({', '.join(ALL_METHODS)})")
BENCHMARKS = list(CFG["data"]["benchmarks"])
# The prompt files the preset reads, under data.root (DEEPSPEC_DATA overrides);
# prepare_data builds the missing ones. A missing file without a known source
# stops the plan here.
DATA_ROOT = data_root(CFG)
DATA_FILES = needed_files(CFG)
try:
    check_sources(CFG)
    preflight(CFG)  # every check that needs only the config and the file system
except DeepSpecError as e:
    raise WorkflowError(f"config error: {e}")


def _one_of(names):
    return "|".join(re.escape(n) for n in names)


wildcard_constraints:
    target=_one_of([TARGET]),
    method=_one_of(ALL_METHODS),
    benchmark=_one_of(BENCHMARKS),


def settings(rule):
    """params.settings of a rule: the fingerprint of the settings it depends on."""
    return settings_fingerprint(CFG, rule)


def res(rule, key, default):
    """Per-rule scheduler resources from the preset (resources.<rule>.<key>)."""
    return CFG["resources"].get(rule, {}).get(key, default)


# gpu_env(n) (deepspec/training/launch.py): the prefix of a GPU rule's command that
# gives the job n GPU ids of its own (Snakemake hands out none on a local machine;
# inside a SLURM job it picks among the ids SLURM set); "" for n = 0.


# ---------------------------------------------------------------- input functions


def target_checkpoint(wc):
    return str(P.target_checkpoint() / "config.json").format(target=wc.target)


def train_data(wc):
    """The cache manifest, or with cache.mode: online the conversations themselves."""
    paths = RunPaths.of(CFG, target=wc.target)
    if CFG["cache"]["mode"] == "online":
        return str(paths.conversations())
    return str(paths.cache_dir() / "manifest.json")


def train_priority(wc):
    """1 for every training job, more for train.start_first's methods (the first highest)."""
    first = CFG["train"]["start_first"]
    return 1 + (len(first) - first.index(wc.method) if wc.method in first else 0)


def train_prompt_files(wc):
    """The training prompt files (hub: sources are read directly)."""
    return [str(DATA_ROOT / e["path"]) for e in CFG["data"]["train"] if not e["path"].startswith("hub:")]


# the benchmarks with a batch-1 timed sample, and so a baseline (eval.speed_benchmarks)
SPEED_BENCHMARKS = speed_benchmarks(CFG)
# the benchmark prompt files on disk (a hub: benchmark is read from the hub)
BENCHMARK_FILES = [str(DATA_ROOT / f) for f in (CFG["data"]["benchmarks"][b]["path"] for b in BENCHMARKS)
                   if not f.startswith("hub:")]


def eval_inputs(wc):
    """evaluate (one job per method, every benchmark) waits for every timed
    benchmark's baseline so that its summaries carry speedup_vs_plain. A method with a
    released checkpoint (eval.released_checkpoints) is evaluated from the hub
    and needs no trained drafter."""
    paths = RunPaths.of(CFG, target=wc.target)
    inputs = {"target": target_checkpoint(wc), "baselines": [str(paths.baseline(b)) for b in SPEED_BENCHMARKS],
              "prompts": BENCHMARK_FILES}
    if wc.method not in CFG["eval"]["released_checkpoints"]:
        inputs["drafter"] = str(paths.drafter_dir(wc.method) / "config.json")
    return inputs


def all_records(methods):
    return [str(PATHS.records(m, b)) for m in methods for b in BENCHMARKS]

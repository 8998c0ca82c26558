# Shared setup: load and validate the preset, build wildcard constraints and
# the command-line fragments every rule passes to `python -m deepspec`.
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir)))
from deepspec.config import load_config
from deepspec.io import DeepSpecError
from deepspec.variants import fig3_methods, fig4_methods

PRESET = str(config.get("preset", "smollm2-135m"))
_OVERRIDES = {k: v for k, v in config.items() if k != "preset"}
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


# Passed verbatim to every deepspec command so it sees the same config.
CONFIG_ARGS = " ".join(
    [f"--preset {shlex.quote(PRESET)}"]
    + [f"--set {shlex.quote(k + '=' + json.dumps(v))}" for k, v in _flatten(_OVERRIDES)]
)

TARGET = CFG["target"]["name"]
RESULTS = CFG["results_dir"]
FIGURES = CFG["figures_dir"]
RESOURCES = CFG["resources_dir"]
METHODS = list(CFG["train"]["methods"])
FIG3_METHODS = fig3_methods(CFG)
FIG4_METHODS = fig4_methods(CFG)
ALL_METHODS = list(dict.fromkeys(METHODS + FIG3_METHODS + FIG4_METHODS))
BENCHMARKS = list(CFG["data"]["benchmarks"])
LOGS = "logs"

wildcard_constraints:
    target="|".join(map(shlex.quote, [TARGET])),
    method="|".join(m.replace("-", "\\-") for m in ALL_METHODS),
    benchmark="|".join(b.replace("-", "\\-") for b in BENCHMARKS),


def res(rule, key, default):
    """Per-rule scheduler resources from the preset (resources.<rule>.<key>)."""
    return CFG["resources"].get(rule, {}).get(key, default)

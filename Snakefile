# DeepSpec: prompts -> regenerated answers -> target cache -> drafters ->
# speculative-decoding evaluation -> Table 1 and Figure 2.
#
# From the repository root (this Snakefile; the rules are in workflow/rules/,
# profiles/default is Snakemake's workflow profile, loaded by itself):
#   snakemake --cores all figures/fig2.pdf                      # CPU default
#   snakemake --cores all figures/fig2.pdf --config preset=tiny  # test preset
#   snakemake --profile profiles/slurm figures/fig2.pdf --config preset=qwen3-4b
#   snakemake --cores all figures/fig7.pdf                      # throughput under load (on demand)
#
# Rules are thin: each calls `python -m deepspec <command>`; all logic lives
# in the deepspec package (workflow/rules/<name>.smk names the module it runs),
# and every path comes from deepspec/paths.py.
import sys
from pathlib import Path

from snakemake.utils import min_version

min_version("9.0")

# The DAG runs the code, presets and schema of the checkout it lives in, also when
# another checkout is installed in the same environment (a git worktree, a second
# clone): this directory goes first on sys.path before anything imports deepspec,
# and deepspec.checkout.enter checks that the Snakefile and every job import it.
CHECKOUT = Path(workflow.basedir).resolve()
if not (CHECKOUT / "deepspec" / "__init__.py").is_file():
    raise WorkflowError(f"{CHECKOUT} has no deepspec/ package beside its Snakefile: run the DAG from a "
                        "DeepSpec checkout (git clone, then pip install -e .)")
sys.path.insert(0, str(CHECKOUT))
try:
    from deepspec.checkout import enter as _enter_checkout
    from deepspec.errors import DeepSpecError

    _enter_checkout(CHECKOUT)
except ImportError as e:  # another deepspec, older than this one, was imported first
    raise WorkflowError(f"checkout error: cannot import deepspec.checkout of {CHECKOUT} ({e})")
except DeepSpecError as e:
    raise WorkflowError(f"checkout error: {e}")


configfile: "config/config.yaml"  # relative to the working directory (the repository root)


include: "workflow/rules/common.smk"


# The default target: Figure 2 (and with it Table 1 and REPORT.md).
rule all:
    input:
        PATHS.figure("fig2.pdf"),
        PATHS.table("table1.csv"),
        PATHS.report(),


include: "workflow/rules/target.smk"
include: "workflow/rules/prepare_data.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/ablations.smk"
include: "workflow/rules/throughput.smk"

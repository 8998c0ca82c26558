# DeepSpec: prompts -> regenerated answers -> target cache -> drafters ->
# speculative-decoding evaluation -> Table 1 and Figure 2.
#
# From the repository root (profiles/default is Snakemake's workflow profile):
#   snakemake --cores all figures/fig2.pdf                      # CPU default
#   snakemake --cores all figures/fig2.pdf --config preset=tiny  # test preset
#   snakemake --profile profiles/slurm figures/fig2.pdf --config preset=qwen3-4b
#   snakemake --cores all figures/fig7.pdf                      # throughput under load (on demand)
#
# Rules are thin: each calls `python -m deepspec <command>`; all logic lives in
# the deepspec package, which the rules reach through deepspec/workflow.py, and
# every path comes from deepspec/paths.py. workflow/rules/<stage>.smk names the
# module each rule runs.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"  # relative to the working directory (the repository root)
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"  # this checkout's package, the preset, the paths


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

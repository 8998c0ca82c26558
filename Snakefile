# DeepSpec: prompts -> regenerated answers -> target cache -> drafters ->
# speculative-decoding evaluation -> Table 1 and Figure 2.
#
#   snakemake --cores all figures/fig2.pdf                      # CPU default
#   snakemake --cores all figures/fig2.pdf --config preset=tiny  # test preset
#   snakemake --profile workflow/profiles/slurm figures/fig2.pdf --config preset=qwen3-4b
#   snakemake --cores all figures/fig7.pdf                      # throughput under load (on demand)
#
# Rules are thin: each calls `python -m deepspec <command>`; all logic lives
# in the deepspec package, one pipeline module per rule file
# (workflow/rules/<name>.smk -> deepspec/pipeline/<name>.py), and every path
# comes from deepspec/paths.py.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


# The default target: Figure 2 (and with it Table 1 and REPORT.md).
rule all:
    input:
        str(PATHS.figure("fig2.pdf")),
        str(PATHS.table("table1.csv")),
        str(PATHS.report()),


include: "workflow/rules/target.smk"
include: "workflow/rules/prepare_data.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/ablations.smk"
include: "workflow/rules/throughput.smk"

# DeepSpec: prompts -> regenerated answers -> target cache -> drafters ->
# speculative-decoding evaluation -> Table 1 and Figure 2.
#
#   snakemake --cores all figures/fig2.pdf                      # CPU default
#   snakemake --cores all --config preset=tiny figures/fig2.pdf  # test preset
#   snakemake --profile workflow/profiles/slurm --config preset=qwen3-4b
#
# Rules are thin: each calls `python -m deepspec <command>`; all logic lives
# in the deepspec package.

configfile: "config/config.yaml"


include: "workflow/rules/common.smk"


# The default target: Figure 2 (and with it Table 1 and REPORT.md).
rule all:
    input:
        f"{FIGURES}/fig2.pdf",
        f"{RESULTS}/tables/table1.csv",
        f"{RESULTS}/REPORT.md",


include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/ablations.smk"

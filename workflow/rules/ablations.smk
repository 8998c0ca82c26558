# Ablations, on demand only (not part of figures/fig2.pdf; deepspec/reporting/ablations.py):
#   snakemake --cores all figures/fig3.pdf   # DSpark 1/2/5 layers vs DFlash 5
#   snakemake --cores all figures/fig4.pdf   # draft length 4/8/12/16: Markov, RNN, DFlash
#   snakemake --cores all figures/fig5.pdf   # confidence-threshold sweep
#   snakemake --cores all figures/fig6.pdf   # calibration before/after STS
FIG5_BENCHMARKS = [b for b in ("gsm8k", "humaneval", "mt-bench") if b in BENCHMARKS] or BENCHMARKS[:1]
ABLATION_INPUTS = {
    "fig3": all_records(FIG3_METHODS),
    "fig4": all_records(FIG4_METHODS),
    "fig5": [PATHS.schedule(b, "sweep.csv") for b in FIG5_BENCHMARKS],
    "fig6": [PATHS.schedule(FIG6_BENCHMARK, "calibration.csv")],  # FIG6_BENCHMARK: common.smk
}


localrules:
    ablation,


rule ablation:
    input:
        lambda wc: ABLATION_INPUTS[wc.fig],
    output:
        pdf=report(PATHS.figure("{fig}.pdf"), caption="../report/ablations.rst", category="Ablations"),
        png=PATHS.figure("{fig}.png"),
        csv=PATHS.table("{fig}.csv"),
    wildcard_constraints:
        fig="fig3|fig4|fig5|fig6",
    log:
        PATHS.log("{fig}"),
    params:
        settings=settings("ablation"),
    resources:
        config_args=CONFIG_ARGS,
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec plot {wildcards.fig} {resources.config_args} --csv {output.csv:q} --pdf {output.pdf:q} > {log:q} 2>&1"

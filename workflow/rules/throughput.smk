# Throughput under load (paper Sec. 3.2.2, Figures 7-8; deepspec/evaluation/throughput.py):
# the batched engine (deepspec/core/engine.py) with each verification policy
# (plain batched decoding, fixed gamma, static thresholds, live Algorithm 1) at
# each throughput.concurrency level; Algorithm 1 reads the STS temperatures the
# schedule rule fitted on DSpark's records (Figure 6's benchmark). On demand:
#   snakemake --cores all figures/fig7.pdf
rule throughput:
    input:
        unpack(throughput_inputs),
    output:
        csv=PATHS.table("throughput.csv"),
    log:
        PATHS.log("throughput"),
    benchmark:
        PATHS.job_benchmark("throughput")
    params:
        settings=settings("throughput"),
        env=EVAL_ENV,
        sts=sts_arg,
        method=THROUGHPUT_METHOD,
    threads: res("throughput", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        **dict(EVAL_RESOURCES, cpus_per_task=res("throughput", "threads", 2)),
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec throughput {resources.config_args} "
        "--method {params.method} {params.sts} --out {output.csv:q} > {log:q} 2>&1"


localrules:
    fig7,


rule fig7:
    input:
        csv=PATHS.table("throughput.csv"),
    output:
        pdf=report(PATHS.figure("fig7.pdf"), caption="../report/fig7.rst", category="Figure 7"),
        png=PATHS.figure("fig7.png"),
    log:
        PATHS.log("fig7"),
    params:
        settings=settings("fig7"),
    resources:
        config_args=CONFIG_ARGS,
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec fig7 {resources.config_args} --csv {input.csv:q} --pdf {output.pdf:q} --png {output.png:q} > {log:q} 2>&1"

# Throughput under load (paper Sec. 3.2.2, Figures 7-8; deepspec/evaluation/throughput.py):
# the batched engine (deepspec/core/engine.py) with each verification policy
# (plain batched decoding, fixed gamma, static thresholds, live Algorithm 1) at
# each throughput.concurrency level; Algorithm 1 reads the STS temperatures the
# schedule rule fitted on DSpark's records (Figure 6's benchmark). On demand:
#   snakemake --cores all figures/fig7.pdf
THROUGHPUT_METHOD = CFG["throughput"]["method"]


def throughput_inputs(wc):
    """The target, the benchmarks' prompts and the drafter (trained, unless it is a released checkpoint)."""
    inputs = {"target": TARGET_CONFIG, "prompts": BENCHMARK_FILES,
              "regenerated": REGENERATION_DONE}  # no GPU job beside the regeneration server
    if THROUGHPUT_METHOD not in CFG["eval"]["released_checkpoints"]:
        inputs["drafter"] = PATHS.drafter_dir(THROUGHPUT_METHOD) / "config.json"
    inputs.update(released_input(THROUGHPUT_METHOD))  # a released hub checkpoint's fetched snapshot
    if THROUGHPUT_METHOD == "dspark":  # Algorithm 1 on STS-calibrated confidences (the schedule rule's fit)
        inputs["sts"] = PATHS.schedule(FIG6_BENCHMARK, "alg1.json")
    return inputs


def sts_arg(wc, input):
    return f"--sts {shlex.quote(input.sts)}" if "sts" in input.keys() else ""


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
    threads: res("throughput", "threads", 2)
    resources:
        **dict(EVAL_RESOURCES, cpus_per_task=res("throughput", "threads", 2)),
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec throughput {CONFIG_ARGS} "
        "--method {THROUGHPUT_METHOD} {params.sts} --out {output.csv:q} > {log:q} 2>&1"


localrules:
    fig7,


rule fig7:
    input:
        csv=PATHS.table("throughput.csv"),
    output:
        pdf=report(PATHS.figure("fig7.pdf"), category="Figure 7"),
        png=PATHS.figure("fig7.png"),
    log:
        PATHS.log("fig7"),
    params:
        settings=settings("fig7"),
    shell:
        "python -m deepspec fig7 {CONFIG_ARGS} --csv {input.csv:q} --pdf {output.pdf:q} --png {output.png:q} > {log:q} 2>&1"

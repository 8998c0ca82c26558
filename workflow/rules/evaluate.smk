# Speculative-decoding evaluation (paper Sec. 4, Table 1;
# deepspec/pipeline/evaluate.py): one job per (target, method) decoding every
# benchmark with the batched engine (its first eval.speed_prompts prompts per
# benchmark alone and timed), the drafter-free baselines per benchmark, and DSpark's verify-smarter analysis
# (threshold sweep, STS calibration, Algorithm 1). GPU presets expose GPU 0
# unless CUDA_VISIBLE_DEVICES is already set (e.g. by SLURM).
EVAL_GPUS = int(CFG["eval"]["gpus"])
EVAL_ENV = gpu_env(min(EVAL_GPUS, 1))
EVAL_RESOURCES = dict(
    mem_mb=res("evaluate", "mem_mb", 4000),
    runtime=res("evaluate", "runtime", 120),
    gpu=res("evaluate", "gpu", EVAL_GPUS),
)


rule evaluate:
    input:
        unpack(eval_inputs),
    output:
        csv=[str(P.records("{method}", b)) for b in BENCHMARKS],
        json=[str(P.summary("{method}", b)) for b in BENCHMARKS],
    log:
        str(P.log("evaluate_{method}")),
    benchmark:
        str(P.log("evaluate_{method}").with_suffix(".benchmark.tsv"))
    params:
        out_dir=lambda wc, output: str(Path(output.csv[0]).parent),
        settings=settings("evaluate"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    resources:
        **EVAL_RESOURCES,
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec evaluate {CONFIG_ARGS} "
        "--method {wildcards.method} --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule baseline:
    input:
        target=target_checkpoint,
        prompts=benchmark_file,
    output:
        json=str(P.baseline("{benchmark}")),
        csv=str(P.baseline("{benchmark}").with_suffix(".csv")),
    log:
        str(P.log("baseline_{benchmark}")),
    benchmark:
        str(P.log("baseline_{benchmark}").with_suffix(".benchmark.tsv"))
    params:
        settings=settings("baseline"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    resources:
        **EVAL_RESOURCES,
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec baseline {CONFIG_ARGS} "
        "--benchmark {wildcards.benchmark} --out {output.json:q} > {log:q} 2>&1"


# Figures 5 and 6 and the Algorithm 1 simulation, from DSpark's records of one benchmark.
rule schedule:
    input:
        records=str(P.records("dspark", "{benchmark}")),
        target=target_checkpoint,
    output:
        sweep=str(P.schedule("{benchmark}", "sweep.csv")),
        calibration=str(P.schedule("{benchmark}", "calibration.csv")),
        alg1=str(P.schedule("{benchmark}", "alg1.json")),
    log:
        str(P.log("schedule_{benchmark}")),
    benchmark:
        str(P.log("schedule_{benchmark}").with_suffix(".benchmark.tsv"))
    params:
        settings=settings("schedule"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    resources:
        **dict(EVAL_RESOURCES, runtime=res("evaluate", "runtime", 30)),
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec schedule {CONFIG_ARGS} --method dspark "
        "--benchmark {wildcards.benchmark} --records {input.records:q} > {log:q} 2>&1"

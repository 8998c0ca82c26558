# Speculative-decoding evaluation (paper Sec. 4, Table 1;
# deepspec/evaluation/evaluate.py): one job per (target, method) decoding every
# benchmark with the batched engine (the first eval.speed_prompts prompts of each
# timed benchmark alone), the drafter-free baselines, and DSpark's
# verify-smarter analysis (threshold sweep, STS calibration, Algorithm 1). On GPU
# presets each job takes a GPU no other job holds (EVAL_ENV, common.smk).


rule evaluate:
    input:
        unpack(eval_inputs),
        regenerated=REGENERATION_DONE,  # no GPU job beside the regeneration server (regenerate.smk)
    output:
        csv=[PATHS.records("{method}", b) for b in BENCHMARKS],
        json=[PATHS.summary("{method}", b) for b in BENCHMARKS],
    log:
        PATHS.log("evaluate_{method}"),
    benchmark:
        PATHS.job_benchmark("evaluate_{method}")
    params:
        out_dir=lambda wc, output: Path(output.csv[0]).parent,
        settings=settings("evaluate"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    priority: eval_priority  # after the trainers, before the baselines (common.smk)
    resources:
        config_args=CONFIG_ARGS,
        **EVAL_RESOURCES,
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec evaluate {resources.config_args} "
        "--method {wildcards.method} --out-dir {params.out_dir:q} > {log:q} 2>&1"


# The drafter-free baselines of the timed benchmarks (eval.speed_benchmarks) in
# eval.baseline_jobs jobs: job {part} times every N-th of them (from the
# {part}-th) in one process, so the start-up (~7 s) and the warm-up are paid
# once per job, not per benchmark. Only the report reads them (the prompt-lookup
# column; evaluate times plain decoding beside each timed prompt itself), so they
# wait for the training data and then fill whatever core the trainers and the
# evaluations leave free, off the critical path. Each job writes its benchmarks'
# <benchmark>.json/.csv and then, through Snakemake, its flag file
# (PATHS.baseline_part), which the report waits for.
rule baseline:
    input:
        target=TARGET_CONFIG,
        prompts=BENCHMARK_FILES,
        regenerated=REGENERATION_DONE,
        after=BASELINE_AFTER,  # ordering only (common.smk)
    output:
        touch(PATHS.baseline_part("{part}", BASELINE_JOBS)),
    wildcard_constraints:
        part=_one_of(map(str, range(BASELINE_JOBS))),
    log:
        PATHS.log("baseline_{part}"),
    benchmark:
        PATHS.job_benchmark("baseline_{part}")
    params:
        benchmarks=baseline_args,
        out_dir=PATHS.baseline_dir(),
        settings=settings("baseline"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        **EVAL_RESOURCES,
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec baseline {resources.config_args} "
        "{params.benchmarks} --out-dir {params.out_dir:q} > {log:q} 2>&1"


# Figures 5 and 6 and the Algorithm 1 simulation, from DSpark's records of one benchmark.
rule schedule:
    input:
        records=PATHS.records("dspark", "{benchmark}"),
        target=TARGET_CONFIG,
    output:
        sweep=PATHS.schedule("{benchmark}", "sweep.csv"),
        calibration=PATHS.schedule("{benchmark}", "calibration.csv"),
        alg1=PATHS.schedule("{benchmark}", "alg1.json"),
    log:
        PATHS.log("schedule_{benchmark}"),
    benchmark:
        PATHS.job_benchmark("schedule_{benchmark}")
    params:
        settings=settings("schedule"),
        env=EVAL_ENV,
    threads: res("evaluate", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        **dict(EVAL_RESOURCES, runtime=res("evaluate", "runtime", 30)),
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec schedule {resources.config_args} --method dspark "
        "--benchmark {wildcards.benchmark} --records {input.records:q} > {log:q} 2>&1"

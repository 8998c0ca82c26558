# Speculative-decoding evaluation (paper Sec. 4, Table 1;
# deepspec/evaluation/evaluate.py): one job per (target, method) decoding every
# benchmark with the batched engine (the first eval.speed_prompts prompts of each
# timed benchmark alone), the drafter-free baselines, and DSpark's
# verify-smarter analysis (threshold sweep, STS calibration, Algorithm 1). On GPU
# presets each job takes a GPU no other job holds (gpu_env: claim-gpus).
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
        regenerated=regeneration_done,  # no GPU job beside the regeneration server (regenerate.smk)
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


# The drafter-free baselines of the timed benchmarks (eval.speed_benchmarks):
# eval.baseline_jobs jobs, each timing every N-th of them (from the I-th) in one
# process, so the start-up (~7 s) and the warm-up are paid once per job, not
# per benchmark. On CPU, two one-thread jobs fill both cores between the
# regeneration and the cache.
BASELINE_PARTS = [SPEED_BENCHMARKS[i :: int(CFG["eval"]["baseline_jobs"])]
                  for i in range(min(int(CFG["eval"]["baseline_jobs"]), len(SPEED_BENCHMARKS)))]

for _i, _benches in enumerate(BASELINE_PARTS):
    _name = "baseline" if len(BASELINE_PARTS) == 1 else f"baseline_{_i}"

    rule:
        name:
            _name
        input:
            target=target_checkpoint,
            prompts=BENCHMARK_FILES,
            regenerated=regeneration_done,
        output:
            json=[str(P.baseline(b)) for b in _benches],
            csv=[str(P.baseline(b).with_suffix(".csv")) for b in _benches],
        log:
            str(P.log(_name)),
        benchmark:
            str(P.log(_name).with_suffix(".benchmark.tsv"))
        params:
            benchmarks=" ".join(f"--benchmark {shlex.quote(b)}" for b in _benches),
            out_dir=lambda wc, output: str(Path(output.json[0]).parent),
            settings=settings("baseline"),
            env=EVAL_ENV,
        threads: res("evaluate", "threads", 2)
        resources:
            **EVAL_RESOURCES,
        shell:
            "OMP_NUM_THREADS={threads} {params.env}python -m deepspec baseline {CONFIG_ARGS} "
            "{params.benchmarks} --out-dir {params.out_dir:q} > {log:q} 2>&1"


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

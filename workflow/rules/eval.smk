# Speculative-decoding evaluation (paper Sec. 4, Table 1): one job per
# (target, method, benchmark), plus the drafter-free baselines per benchmark and
# DSpark's verify-smarter analysis (threshold sweep, STS calibration, Algorithm 1).
#
# A method with a released checkpoint (eval.released_checkpoints) is evaluated
# from the hub and needs no trained drafter. evaluate waits for the baseline of
# its benchmark so its JSON always carries speedup_vs_plain. GPU presets expose
# GPU 0 unless CUDA_VISIBLE_DEVICES is already set (e.g. by SLURM).
EVAL_GPUS = int(CFG["eval"]["gpus"])
EVAL_ENV = 'CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" ' if EVAL_GPUS > 0 else ""


def _eval_inputs(wc):
    inputs = {
        "target": f"{RESOURCES}/targets/{wc.target}/config.json",
        "baseline": f"{RESULTS}/{wc.target}/eval/baseline/{wc.benchmark}.json",
    }
    if wc.method not in CFG["eval"]["released_checkpoints"]:
        inputs["drafter"] = f"{RESULTS}/{wc.target}/drafters/{wc.method}/config.json"
    return inputs


rule evaluate:
    input:
        unpack(_eval_inputs),
    output:
        csv=f"{RESULTS}/{{target}}/eval/{{method}}/{{benchmark}}.csv",
        json=f"{RESULTS}/{{target}}/eval/{{method}}/{{benchmark}}.json",
    log:
        f"{LOGS}/{{target}}/evaluate_{{method}}_{{benchmark}}.log",
    benchmark:
        f"{LOGS}/{{target}}/evaluate_{{method}}_{{benchmark}}.benchmark.tsv"
    params:
        env=EVAL_ENV,
        config_args=CONFIG_ARGS,
    threads: res("evaluate", "threads", 2)
    resources:
        mem_mb=res("evaluate", "mem_mb", 4000),
        runtime=res("evaluate", "runtime", 120),
        gpu=res("evaluate", "gpu", EVAL_GPUS),
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec evaluate {params.config_args} "
        "--method {wildcards.method} --benchmark {wildcards.benchmark} --out {output.csv:q} > {log:q} 2>&1"


rule baseline:
    input:
        target=f"{RESOURCES}/targets/{{target}}/config.json",
    output:
        json=f"{RESULTS}/{{target}}/eval/baseline/{{benchmark}}.json",
        csv=f"{RESULTS}/{{target}}/eval/baseline/{{benchmark}}.csv",
    log:
        f"{LOGS}/{{target}}/baseline_{{benchmark}}.log",
    benchmark:
        f"{LOGS}/{{target}}/baseline_{{benchmark}}.benchmark.tsv"
    params:
        env=EVAL_ENV,
        config_args=CONFIG_ARGS,
    threads: res("evaluate", "threads", 2)
    resources:
        mem_mb=res("evaluate", "mem_mb", 4000),
        runtime=res("evaluate", "runtime", 120),
        gpu=res("evaluate", "gpu", EVAL_GPUS),
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec baseline {params.config_args} "
        "--benchmark {wildcards.benchmark} --out {output.json:q} > {log:q} 2>&1"


# Figures 5 and 6 and the Algorithm 1 simulation, from DSpark's records of one benchmark.
rule schedule:
    input:
        records=f"{RESULTS}/{{target}}/eval/dspark/{{benchmark}}.csv",
        target=f"{RESOURCES}/targets/{{target}}/config.json",
    output:
        sweep=f"{RESULTS}/{{target}}/eval/dspark/{{benchmark}}.sweep.csv",
        calibration=f"{RESULTS}/{{target}}/eval/dspark/{{benchmark}}.calibration.csv",
        alg1=f"{RESULTS}/{{target}}/eval/dspark/{{benchmark}}.alg1.json",
    log:
        f"{LOGS}/{{target}}/schedule_{{benchmark}}.log",
    benchmark:
        f"{LOGS}/{{target}}/schedule_{{benchmark}}.benchmark.tsv"
    params:
        env=EVAL_ENV,
        config_args=CONFIG_ARGS,
    threads: res("evaluate", "threads", 2)
    resources:
        mem_mb=res("evaluate", "mem_mb", 4000),
        runtime=res("evaluate", "runtime", 30),
        gpu=res("evaluate", "gpu", EVAL_GPUS),
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec schedule {params.config_args} --method dspark "
        "--benchmark {wildcards.benchmark} --records {input.records:q} > {log:q} 2>&1"

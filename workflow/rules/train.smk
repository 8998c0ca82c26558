# Train one drafter (a method or an ablation variant such as dspark-l2;
# deepspec/pipeline/train.py) on the target cache, or, with cache.mode: online,
# directly on the regenerated conversations (target features computed on the fly).
#
# With train.gpus > 1 the job runs under `accelerate launch`, one process per
# GPU. An interrupted job resumes from <out>/checkpoints/latest when rerun.
TRAIN_GPUS = int(CFG["train"]["gpus"])
TRAIN_LAUNCHER = gpu_env(TRAIN_GPUS) + (
    f"accelerate launch --num_processes {TRAIN_GPUS} --num_machines 1" if TRAIN_GPUS > 1 else "python"
)


rule train:
    input:
        data=train_data,
        target=target_checkpoint,
    output:
        drafter=str(P.drafter_dir("{method}") / "config.json"),
        log=str(P.drafter_dir("{method}") / "train_log.csv"),
    log:
        str(P.log("train_{method}")),
    benchmark:
        str(P.log("train_{method}").with_suffix(".benchmark.tsv"))
    params:
        settings=settings("train"),
        out=lambda wc, output: str(Path(output.drafter).parent),
        launcher=TRAIN_LAUNCHER,
    threads: res("train", "threads", 2)
    resources:
        mem_mb=res("train", "mem_mb", 16000),
        runtime=res("train", "runtime", 600),
        gpu=res("train", "gpu", TRAIN_GPUS),
    shell:
        "OMP_NUM_THREADS={threads} {params.launcher} -m deepspec train {CONFIG_ARGS} "
        "--method {wildcards.method} --out {params.out:q} > {log:q} 2>&1"

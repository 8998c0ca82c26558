# Train one drafter (a method or an ablation variant such as dspark-l2) on the
# target cache, or, with cache.mode: online, directly on the regenerated
# conversations (target features computed on the fly).
#
# With train.gpus > 1 the job runs under `accelerate launch`, one process per
# GPU; Snakemake does not hand out GPU ids on a local machine, so the rule
# exposes GPUs 0..gpus-1 unless CUDA_VISIBLE_DEVICES is already set (SLURM).
# An interrupted job resumes from <out>/checkpoints/latest when rerun.
TRAIN_GPUS = int(CFG["train"]["gpus"])


def _train_data(wc):
    if CFG["cache"]["mode"] == "online":
        return f"{RESULTS}/{wc.target}/regen/conversations.jsonl"
    return f"{RESULTS}/{wc.target}/cache/manifest.json"


def _train_env_launcher():
    env = ""
    if TRAIN_GPUS > 0:
        ids = ",".join(str(i) for i in range(TRAIN_GPUS))
        env = f'CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{ids}}}" '
    if TRAIN_GPUS > 1:
        return env + f"accelerate launch --num_processes {TRAIN_GPUS} --num_machines 1"
    return env + "python"


rule train:
    input:
        data=_train_data,
        target=f"{RESOURCES}/targets/{{target}}/config.json",
    output:
        drafter=f"{RESULTS}/{{target}}/drafters/{{method}}/config.json",
        log=f"{RESULTS}/{{target}}/drafters/{{method}}/train_log.csv",
    log:
        f"{LOGS}/{{target}}/train_{{method}}.log",
    benchmark:
        f"{LOGS}/{{target}}/train_{{method}}.benchmark.tsv"
    params:
        out=lambda wc, output: str(Path(output.drafter).parent),
        launcher=_train_env_launcher(),
        config_args=CONFIG_ARGS,
    threads: res("train", "threads", 2)
    resources:
        mem_mb=res("train", "mem_mb", 16000),
        runtime=res("train", "runtime", 600),
        gpu=res("train", "gpu", TRAIN_GPUS),
    shell:
        "OMP_NUM_THREADS={threads} {params.launcher} -m deepspec train {params.config_args} "
        "--method {wildcards.method} --out {params.out:q} > {log:q} 2>&1"

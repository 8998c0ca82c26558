# Train one drafter (a method or an ablation variant such as dspark-l2;
# deepspec/training/loop.py) on the target cache, or, with cache.mode: online,
# directly on the regenerated conversations (target features computed on the fly).
#
# The job runs under `accelerate launch` with train.gpus > 1 (one process per
# GPU), or train.processes > 1 on CPU, and with train.nodes > 1 one accelerate
# per node of the SLURM allocation (deepspec/training/launch.py). An
# interrupted job resumes from its newest intact checkpoint when rerun; SIGTERM
# (SLURM's warning before the time limit, profiles/slurm) makes it
# write a checkpoint and stop first.
TRAIN_GPUS = S.train.gpus
TRAIN_NODES = S.train.nodes
TRAIN_PROCS = TRAIN_GPUS or S.train.processes  # per node
if res("train", "nodes", TRAIN_NODES) != TRAIN_NODES:
    raise WorkflowError(f"config error: resources.train.nodes ({res('train', 'nodes', TRAIN_NODES)}) differs from "
                        f"train.nodes ({TRAIN_NODES}): set train.nodes only")
# resources.train.gpu is per node: the job (SLURM's --gpus, a total) gets it x train.nodes
TRAIN_JOB_GPUS = res("train", "gpu", TRAIN_GPUS) * TRAIN_NODES
# one machine: the job's own GPU ids (claim-gpus); several nodes: SLURM's
TRAIN_GPU_ENV = gpu_env(TRAIN_GPUS) if TRAIN_NODES == 1 else ""
TRAIN_OMP = max(1, res("train", "threads", 2) // TRAIN_PROCS)  # threads per process
# GPU training: the allocator maps memory in growable segments (less fragmentation
# when every micro batch has another length)
TRAIN_ENV = f"OMP_NUM_THREADS={TRAIN_OMP} " + ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True " if TRAIN_GPUS else "")
# on SIGTERM the launcher gives the processes 10 min (not 30 s) to write their checkpoint
TRAIN_ENV += "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 " if TRAIN_PROCS * TRAIN_NODES > 1 else ""


rule train:
    input:
        data=train_data,
        target=TARGET_CONFIG,
    output:
        drafter=PATHS.drafter_dir("{method}") / "config.json",
        log=PATHS.drafter_dir("{method}") / "train_log.csv",
    log:
        PATHS.log("train_{method}"),
    benchmark:
        PATHS.job_benchmark("train_{method}")
    params:
        settings=settings("train"),
        out=lambda wc, output: Path(output.drafter).parent,
        # each method its own rendezvous port (train_port, common.smk)
        launcher=lambda wc: TRAIN_GPU_ENV + train_launcher(S.train, train_port(wc), res("train", "threads", 2)),
        env=TRAIN_ENV,
    threads: res("train", "threads", 2)
    # every drafter trains before any evaluation starts: on 2 cores the three
    # evaluations then share both lanes instead of one lane running a drafter's
    # training and evaluation back to back at the end (CPU default: 23.3 -> 20.8 min);
    # train.start_first's methods before the others (the longest training first)
    priority: train_priority
    resources:
        config_args=CONFIG_ARGS,
        mem_mb=res("train", "mem_mb", 16000),
        cpus_per_task=res("train", "threads", 2),
        runtime=res("train", "runtime", 600),
        gpu=TRAIN_JOB_GPUS,
        nodes=res("train", "nodes", TRAIN_NODES),
    conda:
        "../../environment.yml"
    shell:
        # exec: the launcher (claim-gpus, accelerate, torchrun, srun or python itself)
        # replaces this shell, so a SIGTERM to the job (SLURM's warning ahead of the time
        # limit, Snakemake stopping it) reaches it: bash would die at once and leave the
        # trainers to be killed before their checkpoint
        "exec env {params.env}{params.launcher} -m deepspec train {resources.config_args} "
        "--method {wildcards.method} --out {params.out:q} > {log:q} 2>&1"

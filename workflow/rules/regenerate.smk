# Regenerate every training answer with the target itself (paper §3,
# "Regeneration"; deepspec/pipeline/regenerate.py). Resumable: progress lives
# in <output>.partial, which Snakemake does not delete on failure; a rerun
# skips finished records.
#
# With regenerate.shards = N > 1, N jobs each regenerate every N-th prompt (from
# the I-th) into regen/shards/, and `regenerate` merges them: on CPU two
# one-thread jobs decode 1.36x faster than one two-thread job (the decode
# matmuls are too small to share; README "CPU presets"), on GPUs or SLURM each
# shard is a job of its own. Every record has its own seed, so its answer does
# not depend on the shard it is in.
REGEN_SHARDS = int(CFG["regenerate"]["shards"])
REGEN_RESOURCES = dict(
    mem_mb=res("regenerate", "mem_mb", 4000),
    runtime=res("regenerate", "runtime", 60),
    gpu=res("regenerate", "gpu", 0),
)
REGEN_ENV = gpu_env(REGEN_RESOURCES["gpu"])  # each job (shard) its own GPUs on one machine

if REGEN_SHARDS == 1:

    rule regenerate:
        input:
            target=target_checkpoint,
            prompts=train_prompt_files,
        output:
            str(P.conversations()),
        log:
            str(P.log("regenerate")),
        benchmark:
            str(P.log("regenerate").with_suffix(".benchmark.tsv"))
        params:
            settings=settings("regenerate"),
        threads: res("regenerate", "threads", 2)
        priority: 1
        resources:
            **REGEN_RESOURCES,
        shell:
            "OMP_NUM_THREADS={threads} {REGEN_ENV}python -m deepspec regenerate {CONFIG_ARGS} --out {output:q} > {log:q} 2>&1"

else:

    rule regenerate_shard:
        input:
            target=target_checkpoint,
            prompts=train_prompt_files,
        output:
            str(P.conversations_shard("{shard}", REGEN_SHARDS)),
        wildcard_constraints:
            shard=r"\d+",
        log:
            str(P.log("regenerate_{shard}")),
        benchmark:
            str(P.log("regenerate_{shard}").with_suffix(".benchmark.tsv"))
        params:
            settings=settings("regenerate"),
        threads: res("regenerate", "threads", 2)
        # the critical path: the shards start before the baselines, which fill the cores later
        priority: 1
        resources:
            **REGEN_RESOURCES,
        shell:
            "OMP_NUM_THREADS={threads} {REGEN_ENV}python -m deepspec regenerate {CONFIG_ARGS} "
            "--shard {wildcards.shard}/" + str(REGEN_SHARDS) + " --out {output:q} > {log:q} 2>&1"

    rule regenerate:
        input:
            shards=[str(P.conversations_shard(i, REGEN_SHARDS)) for i in range(REGEN_SHARDS)],
            prompts=train_prompt_files,
        output:
            str(P.conversations()),
        log:
            str(P.log("regenerate")),
        params:
            settings=settings("regenerate"),
        threads: 1
        priority: 1
        shell:
            "python -m deepspec regenerate {CONFIG_ARGS} --merge {input.shards:q} --out {output:q} > {log:q} 2>&1"

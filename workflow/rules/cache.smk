# Tokenise the regenerated conversations once (chat template, assistant loss mask;
# deepspec/data/conversations.py), in a pool of processes on CPU, before any cache
# or training job: those then map the token arrays instead of one of them
# tokenising while the others (and their GPUs) wait. The output records where the
# arrays are (beside the conversations, named by a digest of what made them).
rule tokenize:
    input:
        conversations=PATHS.conversations(),
        target=TARGET_CONFIG,
    output:
        PATHS.tokens_record(),
    log:
        PATHS.log("tokenize"),
    benchmark:
        PATHS.job_benchmark("tokenize")
    params:
        settings=settings("tokenize"),
    threads: res("tokenize", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        mem_mb=res("tokenize", "mem_mb", 8000),
        cpus_per_task=res("tokenize", "threads", 2),
        runtime=res("tokenize", "runtime", 120),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec tokenize {resources.config_args} --conversations {input.conversations:q} --workers {threads} "
        "--out {output:q} > {log:q} 2>&1"


# Cache the target's feature-layer and final hidden states (paper §3, "Target
# cache"; deepspec/data/cache.py). The directory is the output, marked by
# its manifest (written last). Resumable: finished shards survive a failed job
# and are checksum-verified and kept by the rerun.
rule build_cache:
    input:
        conversations=PATHS.conversations(),
        tokens=PATHS.tokens_record(),
        target=TARGET_CONFIG,
    output:
        PATHS.cache_dir() / "manifest.json",
    log:
        PATHS.log("build_cache"),
    benchmark:
        PATHS.job_benchmark("build_cache")
    params:
        settings=settings("build_cache"),
        out=PATHS.cache_dir(),
        env=gpu_env(res("build_cache", "gpu", 0)),  # its own GPUs on one machine
    threads: res("build_cache", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        mem_mb=res("build_cache", "mem_mb", 6000),
        cpus_per_task=res("build_cache", "threads", 2),
        runtime=res("build_cache", "runtime", 60),
        gpu=res("build_cache", "gpu", 0),
    conda:
        "../../environment.yml"
    shell:
        "{params.env}python -m deepspec build-cache {resources.config_args} --conversations {input.conversations:q} --out {params.out:q} > {log:q} 2>&1"

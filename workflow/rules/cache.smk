# Cache the target's feature-layer and final hidden states (paper §3, "Target
# cache"; deepspec/data/cache.py). The directory is the output, marked by
# its manifest (written last). Resumable: finished shards survive a failed job
# and are checksum-verified and kept by the rerun.
rule build_cache:
    input:
        conversations=PATHS.conversations(),
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
        mem_mb=res("build_cache", "mem_mb", 6000),
        cpus_per_task=res("build_cache", "threads", 2),
        runtime=res("build_cache", "runtime", 60),
        gpu=res("build_cache", "gpu", 0),
    shell:
        "{params.env}python -m deepspec build-cache {CONFIG_ARGS} --conversations {input.conversations:q} --out {params.out:q} > {log:q} 2>&1"

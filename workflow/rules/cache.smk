# Cache the target's feature-layer and final hidden states (paper §3, "Target
# cache"). The directory is the output, marked by its manifest (written last).
# Resumable: finished shards survive a failed job and are checksum-verified
# and kept by the rerun.
rule build_cache:
    input:
        conversations=f"{RESULTS}/{{target}}/regen/conversations.jsonl",
        target=f"{RESOURCES}/targets/{{target}}/config.json",
    output:
        f"{RESULTS}/{{target}}/cache/manifest.json",
    log:
        f"{LOGS}/{{target}}/build_cache.log",
    benchmark:
        f"{LOGS}/{{target}}/build_cache.benchmark.tsv"
    params:
        out=lambda wc, output: str(Path(output[0]).parent),
    threads: res("build_cache", "threads", 2)
    resources:
        mem_mb=res("build_cache", "mem_mb", 6000),
        runtime=res("build_cache", "runtime", 60),
        gpu=res("build_cache", "gpu", 0),
    shell:
        "python -m deepspec build-cache {CONFIG_ARGS} --conversations {input.conversations:q} --out {params.out:q} > {log:q} 2>&1"

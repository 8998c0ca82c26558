# Regenerate every training answer with the target itself (paper §3,
# "Regeneration"). Resumable: progress lives in <output>.partial, which
# Snakemake does not delete on failure; a rerun skips finished records.
rule regenerate:
    input:
        target=f"{RESOURCES}/targets/{{target}}/config.json",
    output:
        f"{RESULTS}/{{target}}/regen/conversations.jsonl",
    log:
        f"{LOGS}/{{target}}/regenerate.log",
    benchmark:
        f"{LOGS}/{{target}}/regenerate.benchmark.tsv"
    threads: res("regenerate", "threads", 2)
    resources:
        mem_mb=res("regenerate", "mem_mb", 4000),
        runtime=res("regenerate", "runtime", 60),
        gpu=res("regenerate", "gpu", 0),
    shell:
        "python -m deepspec regenerate {CONFIG_ARGS} --out {output:q} > {log:q} 2>&1"

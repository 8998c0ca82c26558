# Regenerate every training answer with the target itself (paper §3,
# "Regeneration"; deepspec/pipeline/regenerate.py). Resumable: progress lives
# in <output>.partial, which Snakemake does not delete on failure; a rerun
# skips finished records.
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
    resources:
        mem_mb=res("regenerate", "mem_mb", 4000),
        runtime=res("regenerate", "runtime", 60),
        gpu=res("regenerate", "gpu", 0),
    shell:
        "python -m deepspec regenerate {CONFIG_ARGS} --out {output:q} > {log:q} 2>&1"

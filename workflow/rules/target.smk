# Convert (builtin) or download (hub) the target into a plain HF checkpoint
# (deepspec/pipeline/target.py).
rule prepare_target:
    output:
        str(P.target_checkpoint() / "config.json"),
    log:
        str(P.log("prepare_target")),
    params:
        settings=settings("prepare_target"),
        spec=CFG["target"]["spec"],
        out=lambda wc, output: str(Path(output[0]).parent),
    resources:
        mem_mb=res("prepare_target", "mem_mb", 4000),
        runtime=res("prepare_target", "runtime", 30),
    shell:
        "python -m deepspec prepare-target {params.spec:q} --out {params.out:q} > {log:q} 2>&1"

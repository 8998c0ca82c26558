# Convert (builtin) or download (hub, at target.revision) the target into a plain
# HF checkpoint (deepspec/targets/loading.py). A local rule: it needs no GPU, and on
# a cluster the node running Snakemake has the internet access compute nodes may
# lack (as prepare_data). Hub files land in the hub cache (HF_HOME) and are hard
# linked into resources/targets/, not loaded into memory.
localrules:
    prepare_target,


rule prepare_target:
    output:
        TARGET_CONFIG,
    log:
        PATHS.log("prepare_target"),
    params:
        settings=settings("prepare_target"),
        spec=S.target.spec,
        revision=f"--revision {shlex.quote(S.target.revision)} " if S.target.revision else "",
        out=PATHS.target_checkpoint(),
    resources:
        mem_mb=res("prepare_target", "mem_mb", 4000),
        runtime=res("prepare_target", "runtime", 120),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec prepare-target {params.spec:q} {params.revision}--out {params.out:q} > {log:q} 2>&1"

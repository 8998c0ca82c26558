# The trained drafters served in vLLM and checked against our own decoding
# (deepspec/serving/serve_check.py): each is exported as vLLM loads it, vLLM
# decodes the evaluation prompts with and without speculation, and the record
# says whether the output is lossless, whether every round accepted what ours
# did, and tau in vLLM at the evaluation temperature. On demand
# (`snakemake results/<target>/serve/eagle3.json`), or before the report with
# serve.engine=vllm. vLLM runs DFlash/DSpark in its GPU model runner only, so a
# CPU preset checks Eagle3.
SERVED_METHODS = [m for m in METHODS if S.target.device != "cpu" or m == "eagle3"]


rule serve_check:
    input:
        unpack(eval_inputs),
        records=lambda wc: [PATHS.records(wc.method, b) for b in BENCHMARKS],
    output:
        PATHS.serve_check("{method}"),
    log:
        PATHS.log("serve_check_{method}"),
    params:
        settings=settings("serve_check"),
        env=EVAL_ENV,
    threads: res("serve_check", "threads", 2)
    resources:
        config_args=CONFIG_ARGS,
        **dict(EVAL_RESOURCES, cpus_per_task=res("serve_check", "threads", 2)),
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={threads} {params.env}python -m deepspec serve-check {resources.config_args} "
        "--method {wildcards.method} --out {output:q} --allow-fail > {log:q} 2>&1"

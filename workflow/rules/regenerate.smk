# Regenerate every training answer with the target itself (paper §3,
# "Regeneration"; deepspec/regeneration/regenerate.py). Resumable: progress lives
# in <output>.partial, which Snakemake does not delete on failure; a rerun
# skips finished records.
#
# regenerate.shards = N jobs (regenerate_shard) each regenerate every N-th
# prompt (from the I-th) into regen/shards/, and `regenerate` merges them into
# the conversations file, in the training prompts' order (for N = 1 the merge
# copies the one shard): on CPU two one-thread jobs decode 1.36x faster than one
# two-thread job (the decode matmuls are too small to share; docs/RESULTS.md),
# on GPUs or SLURM each shard is a job of its own. Every record has
# its own seed, so its answer does not depend on the shard it is in.
#
# With regenerate.server set, the DAG starts the server itself: the rule
# regenerate_server runs its command line as a Snakemake service job (output
# marked service(); `exec` run-server, so Snakemake's signals reach it) in the
# group "regenerate" with the shards that consume it, so on SLURM they are one
# job on one node (the shards reach it at 127.0.0.1) and locally they run side
# by side. Each shard first waits for this run's server to be ready
# (server.health_timeout_s; at once an error when it failed). Snakemake terminates
# the service once every shard is done; the merge, outside the group, then waits
# for the server's supervisor (and so its process group) to be gone
# (regen/server.json), and baseline/evaluate wait for the merge
# (REGENERATION_DONE, common.smk), so no GPU job shares GPUs with a running server.
# Snakemake docs: service rules and group-local service jobs,
# https://snakemake.readthedocs.io/en/stable/snakefiles/rules.html#service-rules-jobs ;
# group jobs (one connected component per group job, resources summed over the
# jobs that run in parallel), https://snakemake.readthedocs.io/en/stable/executing/grouping.html
# The service connects every shard into one group job, which is what we want
# here (one server, one node; on SLURM the shards then share its job instead
# of being jobs of their own); --group-components is not needed.
REGEN_SHARDS = S.regenerate.shards
REGEN_RESOURCES = dict(
    mem_mb=res("regenerate", "mem_mb", 4000),
    runtime=res("regenerate", "runtime", 60),
    gpu=res("regenerate", "gpu", 0),
)
REGEN_ENV = gpu_env(REGEN_RESOURCES["gpu"])  # each job (shard) its own GPUs on one machine

if REGEN_SERVER and S.regenerate.backend != "server":
    raise WorkflowError("config error: regenerate.server is set but regenerate.backend is "
                        f"{S.regenerate.backend!r}: set regenerate.backend=server (or regenerate.server=null)")

# The server rule exists only when there is a server to start (regenerate.server);
# the shards then take its service as an input (regen_server_input). The server
# runs under `python -m deepspec run-server` (deepspec/regeneration/supervisor.py): it
# checks the command's program and the port (regenerate.server.port null: one
# chosen when it starts), claims the server's GPUs, starts the command in a
# process group of its own, reports its state in regen/server.json under this
# run's token, and stops the whole group when Snakemake terminates it, when the
# snakemake that started it is gone, or (a watchdog) when it is SIGKILLed. Each
# shard gets the same token (--server-token) and sends requests only to the
# server that reports it ready; one that failed, stopped or is gone fails the
# shard in one line, at once.
# this snakemake's run (a SLURM group job's inner snakemake: its own); a resource of
# the server and its shards (resources.server_token), which reruns nothing
REGEN_TOKEN = uuid.uuid4().hex[:16]
if REGEN_SERVER:
    _srv = REGEN_SERVER
    _host = _srv["host"] or "127.0.0.1"
    try:
        SERVER_COMMAND, _engine = server_command(S)  # deepspec/workflow.py
    except DeepSpecError as e:
        raise WorkflowError(f"config error: {e}")
    SERVER_ENGINE = f"--engine {_engine} " if _engine else ""  # its /version is checked

    rule regenerate_server:
        input:
            target=TARGET_CONFIG,
        output:
            service(PATHS.server_service()),
        log:
            PATHS.log("regenerate_server"),
        params:
            command=lambda wc: SERVER_COMMAND,  # a function: {port} is not a wildcard
            status=PATHS.server_status(),
            host=_host,
            port=_srv["port"] or "auto",
            gpus=int(_srv["gpus"]),
            engine=SERVER_ENGINE,
        group:
            "regenerate"
        threads: int(_srv["threads"])
        resources:
            config_args=CONFIG_ARGS,
            server_token=REGEN_TOKEN,
            mem_mb=int(_srv["mem_mb"]),
            cpus_per_task=int(_srv["threads"]),
            runtime=res("regenerate", "runtime", 60),
            gpu=int(_srv["gpus"]),
        conda:
            "../../environment.yml"
        shell:
            # exec: run-server replaces this shell, so Snakemake's SIGTERM (the shards
            # are done) and SIGKILL (a shard failed) reach it
            "touch {output:q}; exec python -m deepspec run-server --status {params.status:q} --token {resources.server_token} "
            "--host {params.host:q} --port {params.port} --gpus {params.gpus} --log {log:q} {params.engine}{params.command:q} "
            "> {log:q} 2>&1"


rule regenerate_shard:
    input:
        unpack(regen_server_input),
        target=TARGET_CONFIG,
        prompts=TRAIN_PROMPT_FILES,
    output:
        PATHS.conversations_shard("{shard}", REGEN_SHARDS),
    wildcard_constraints:
        shard=r"\d+",
    log:
        PATHS.log("regenerate_{shard}"),
    benchmark:
        PATHS.job_benchmark("regenerate_{shard}")
    params:
        settings=settings("regenerate"),
        env=REGEN_ENV,
        shards=REGEN_SHARDS,
        # beside a server one thread sends the requests
        omp=lambda wc, threads: 1 if REGEN_SERVER else threads,
    group:
        "regenerate" if REGEN_SERVER else None
    # beside a server a shard only sends requests: no core of its own
    threads: 0 if REGEN_SERVER else res("regenerate", "threads", 2)
    # the critical path: the shards first
    priority: 1
    resources:
        config_args=CONFIG_ARGS,
        server_token=REGEN_TOKEN,
        **REGEN_RESOURCES,
        cpus_per_task=0 if REGEN_SERVER else res("regenerate", "threads", 2),
    conda:
        "../../environment.yml"
    shell:
        "OMP_NUM_THREADS={params.omp} {params.env}python -m deepspec regenerate {resources.config_args} "
        "--shard {wildcards.shard}/{params.shards} --server-token {resources.server_token} --out {output:q} > {log:q} 2>&1"


rule regenerate:
    input:
        shards=[PATHS.conversations_shard(i, REGEN_SHARDS) for i in range(REGEN_SHARDS)],
        prompts=TRAIN_PROMPT_FILES,
    output:
        PATHS.conversations(),
    log:
        PATHS.log("regenerate"),
    params:
        settings=settings("regenerate"),
        wait=f"--wait-server-exit {shlex.quote(str(PATHS.server_status()))}" if REGEN_SERVER else "",
    threads: 1
    priority: 1
    # a streamed merge (deepspec/regeneration/shards.py): the prompt ids and 16 bytes per record, never the records
    resources:
        config_args=CONFIG_ARGS,
        mem_mb=res("regenerate_merge", "mem_mb", 8000),
        runtime=res("regenerate_merge", "runtime", 120),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec regenerate {resources.config_args} --merge {input.shards:q} {params.wait} --out {output:q} > {log:q} 2>&1"

# Regenerate every training answer with the target itself (paper §3,
# "Regeneration"; deepspec/data/regenerate.py). Resumable: progress lives
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
# marked service(); `exec`, so Snakemake's SIGTERM reaches the server) in the
# group "regenerate" with the shards that consume it, so on SLURM they are one
# job on one node (the shards reach it at 127.0.0.1) and locally they run side
# by side. Each shard first waits for the server's /v1/models
# (server.health_timeout_s). Snakemake terminates the service once every shard
# is done; the merge, outside the group, then waits for the server process to
# be gone (regen/server.pid), and baseline/evaluate wait for the merge
# (REGENERATION_DONE, common.smk), so no GPU job shares GPUs with a running server.
# Snakemake docs: service rules and group-local service jobs,
# https://snakemake.readthedocs.io/en/stable/snakefiles/rules.html#service-rules-jobs ;
# group jobs (one connected component per group job, resources summed over the
# jobs that run in parallel), https://snakemake.readthedocs.io/en/stable/executing/grouping.html
# The service connects every shard into one group job, which is what we want
# here (one server, one node; on SLURM the shards then share its job instead
# of being jobs of their own); --group-components is not needed.
REGEN_SHARDS = int(CFG["regenerate"]["shards"])
REGEN_RESOURCES = dict(
    mem_mb=res("regenerate", "mem_mb", 4000),
    runtime=res("regenerate", "runtime", 60),
    gpu=res("regenerate", "gpu", 0),
)
REGEN_ENV = gpu_env(REGEN_RESOURCES["gpu"])  # each job (shard) its own GPUs on one machine

if REGEN_SERVER and CFG["regenerate"]["backend"] != "server":
    raise WorkflowError("config error: regenerate.server is set but regenerate.backend is "
                        f"{CFG['regenerate']['backend']!r}: set regenerate.backend=server (or regenerate.server=null)")

# The server rule exists only when there is a server to start (regenerate.server);
# the shards then take its service as an input (regen_server_input).
if REGEN_SERVER:
    _srv = REGEN_SERVER
    try:
        SERVER_COMMAND = _srv["command"].format(
            model=shlex.quote(str(PATHS.target_checkpoint())),
            port=_srv["port"],
            host=_srv["host"] or "127.0.0.1",
            name=shlex.quote(CFG["regenerate"]["model_name"] or CFG["target"]["spec"]),
        )
    except (KeyError, IndexError, ValueError) as e:
        raise WorkflowError(f"config error: regenerate.server.command: cannot fill in {e} (placeholders: {{model}}, "
                            "{port}, {host}, {name}; write literal braces as {{ and }})")
    if SERVER_COMMAND.split()[:1] == ["vllm"]:  # vLLM in this environment or its own (deepspec/interop/engine_env.py)
        try:
            SERVER_COMMAND = vllm_command(CFG["serve"]["vllm_python"]) + SERVER_COMMAND[len("vllm"):]
        except DeepSpecError as e:  # planned anyway (a dry run of a GPU preset on a laptop); the server job fails
            logger.warning(f"the regeneration server runs vLLM: {e}")

    rule regenerate_server:
        input:
            target=TARGET_CONFIG,
        output:
            service(PATHS.server_service()),
        log:
            PATHS.log("regenerate_server"),
        params:
            command=SERVER_COMMAND,
            env=gpu_env(int(_srv["gpus"])),
            pid=PATHS.server_pid(),
        group:
            "regenerate"
        threads: int(_srv["threads"])
        resources:
            mem_mb=int(_srv["mem_mb"]),
            cpus_per_task=int(_srv["threads"]),
            runtime=res("regenerate", "runtime", 60),
            gpu=int(_srv["gpus"]),
        shell:
            # $$ is this shell, which exec turns into the server
            'echo "$(hostname) $$" > {params.pid:q}; touch {output:q}; '
            # exec: claim-gpus (when it holds GPUs) and then the server replace this
            # shell, so Snakemake's SIGTERM reaches the server
            "exec {params.env}{params.command} > {log:q} 2>&1"


def regen_server_input(wc):
    return {"server": PATHS.server_service()} if REGEN_SERVER else {}


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
    group:
        "regenerate" if REGEN_SERVER else None
    # beside a server a shard only sends requests: no core of its own
    threads: 0 if REGEN_SERVER else res("regenerate", "threads", 2)
    # the critical path: the shards start before the baselines, which fill the cores later
    priority: 1
    resources:
        **REGEN_RESOURCES,
        cpus_per_task=0 if REGEN_SERVER else res("regenerate", "threads", 2),
    shell:
        # the same command text for a given N (a changed text would rerun finished shards: the code trigger)
        "OMP_NUM_THREADS=" + ("1" if REGEN_SERVER else "{threads}") + " {REGEN_ENV}python -m deepspec regenerate {CONFIG_ARGS} "
        "--shard {wildcards.shard}/" + str(REGEN_SHARDS) + " --out {output:q} > {log:q} 2>&1"


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
        wait=f"--wait-server-exit {shlex.quote(str(PATHS.server_pid()))}" if REGEN_SERVER else "",
    threads: 1
    priority: 1
    shell:
        "python -m deepspec regenerate {CONFIG_ARGS} --merge {input.shards:q} {params.wait} --out {output:q} > {log:q} 2>&1"

# The preset's prompt files under data.root, built from their public sources
# when missing (deepspec/data/sources.py): one job per file, so a
# failed download never touches the files that are there. A file that exists
# is up to date (no inputs) and is never rebuilt; hence no params.settings:
# prompt files are data, and a changed source (data.sources) is rebuilt only
# after the file is deleted. A built file whose sha256 differs from its pin
# fails the job (the log names the file and the prepare-data command that
# accepts it); the rule never accepts one itself. Local rule: compute nodes
# may lack internet.
localrules:
    prepare_data,


rule prepare_data:
    output:
        DATA_ROOT / "{datafile}",
    log:
        PATHS.log("prepare_data", "{datafile}"),
    wildcard_constraints:
        datafile=_one_of(DATA_FILES),
    threads: 1
    resources:
        config_args=CONFIG_ARGS,
        mem_mb=res("prepare_data", "mem_mb", 8000),
        runtime=res("prepare_data", "runtime", 60),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec prepare-data {resources.config_args} --file {wildcards.datafile:q} > {log:q} 2>&1"


# Hub snapshots at the revisions the preset pins (deepspec/fetch.py): the training datasets
# (data.train entries hub:<id> with their revision) and DeepSeek's released drafters
# (eval.released_checkpoints.<method>: {hub, revision}). Local rules, as prepare_target: the
# node running Snakemake has the internet access compute nodes may lack, and the regeneration
# shards (which would otherwise download after their vLLM server started) and evaluations read
# the snapshots from resources/hub/. A snapshot is never fetched again: a new revision is a new
# directory (and a new settings fingerprint for the rules that read it).
localrules:
    fetch_dataset,
    fetch_released,


rule fetch_dataset:
    output:
        hub_record("datasets", "{snapshot}"),
    log:
        PATHS.log("fetch_dataset", "{snapshot}"),
    wildcard_constraints:
        snapshot=_one_of(HUB_DATASETS) if HUB_DATASETS else "(?!)",
    params:
        repo=lambda wc: HUB_DATASETS[wc.snapshot][0],
        revision=lambda wc: HUB_DATASETS[wc.snapshot][1],
        out=lambda wc, output: Path(output[0]).parent,
    threads: 1
    resources:
        mem_mb=res("fetch", "mem_mb", 4000),
        runtime=res("fetch", "runtime", 240),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec fetch-hub --repo-type dataset --repo {params.repo:q} --revision {params.revision:q} "
        "--out {params.out:q} > {log:q} 2>&1"


rule fetch_released:
    output:
        hub_record("models", "{snapshot}"),
    log:
        PATHS.log("fetch_released", "{snapshot}"),
    wildcard_constraints:
        snapshot=_one_of(RELEASED_HUB) if RELEASED_HUB else "(?!)",
    params:
        repo=lambda wc: RELEASED_HUB[wc.snapshot][0],
        revision=lambda wc: RELEASED_HUB[wc.snapshot][1],
        out=lambda wc, output: Path(output[0]).parent,
    threads: 1
    resources:
        mem_mb=res("fetch", "mem_mb", 4000),
        runtime=res("fetch", "runtime", 240),
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec fetch-hub --repo-type model --allow '*.json' --allow '*.safetensors' --repo {params.repo:q} "
        "--revision {params.revision:q} --out {params.out:q} > {log:q} 2>&1"

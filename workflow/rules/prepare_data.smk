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
        mem_mb=res("prepare_data", "mem_mb", 8000),
        runtime=res("prepare_data", "runtime", 60),
    shell:
        "python -m deepspec prepare-data {CONFIG_ARGS} --file {wildcards.datafile:q} > {log:q} 2>&1"

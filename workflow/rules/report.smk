# Table 1, Figure 2, REPORT.md and provenance.json (what the results were made
# with: deepspec/provenance.py) from every (method, benchmark) evaluation, and the
# training curves from every trained drafter's train_log.csv (a train output; the
# released checkpoints of eval.released_checkpoints have none)
# (deepspec/reporting/report.py).
localrules:
    report,


rule report:
    input:
        records=all_records(METHODS),
        summaries=[PATHS.summary(m, b) for m in METHODS for b in BENCHMARKS],
        baselines=BASELINES,
        served=[PATHS.serve_check(m) for m in SERVED_METHODS] if S.serve.engine else [],
        train_logs=[PATHS.drafter_dir(m) / "train_log.csv" for m in METHODS
                    if m not in S.eval.released_checkpoints],
    output:
        table1=report(PATHS.table("table1.csv"), caption="../report/table1.rst", category="Table 1"),
        table1_md=PATHS.table("table1.md"),
        fig2_csv=PATHS.table("fig2.csv"),
        fig2=report(PATHS.figure("fig2.pdf"), caption="../report/fig2.rst", category="Figure 2"),
        fig2_png=PATHS.figure("fig2.png"),
        training=report(PATHS.figure("training.pdf"), caption="../report/training.rst", category="Training"),
        training_png=PATHS.figure("training.png"),
        report=PATHS.report(),
        provenance=PATHS.provenance(),
    log:
        PATHS.log("report"),
    params:
        settings=settings("report"),
    resources:
        config_args=CONFIG_ARGS,
    conda:
        "../../environment.yml"
    shell:
        "python -m deepspec report {resources.config_args} --table1 {output.table1:q} --table1-md {output.table1_md:q} "
        "--fig2-csv {output.fig2_csv:q} --fig2-pdf {output.fig2:q} --fig2-png {output.fig2_png:q} "
        "--training-pdf {output.training:q} --training-png {output.training_png:q} "
        "--report {output.report:q} --provenance {output.provenance:q} > {log:q} 2>&1"

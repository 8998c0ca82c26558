# Table 1, Figure 2 and REPORT.md from every (method, benchmark) evaluation
# (deepspec/reporting/report.py).
rule report:
    input:
        records=all_records(METHODS),
        summaries=[str(PATHS.summary(m, b)) for m in METHODS for b in BENCHMARKS],
        baselines=[str(PATHS.baseline(b)) for b in SPEED_BENCHMARKS],
    output:
        table1=report(str(PATHS.table("table1.csv")), category="Table 1"),
        table1_md=str(PATHS.table("table1.md")),
        fig2_csv=str(PATHS.table("fig2.csv")),
        fig2=report(str(PATHS.figure("fig2.pdf")), category="Figure 2"),
        fig2_png=str(PATHS.figure("fig2.png")),
        report=str(PATHS.report()),
    log:
        str(PATHS.log("report")),
    params:
        settings=settings("report"),
    shell:
        "python -m deepspec report {CONFIG_ARGS} --table1 {output.table1:q} --table1-md {output.table1_md:q} "
        "--fig2-csv {output.fig2_csv:q} --fig2-pdf {output.fig2:q} --fig2-png {output.fig2_png:q} "
        "--report {output.report:q} > {log:q} 2>&1"

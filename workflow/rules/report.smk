# Table 1, Figure 2 and REPORT.md from every (method, benchmark) evaluation.
rule report:
    input:
        records=expand(f"{RESULTS}/{TARGET}/eval/{{method}}/{{benchmark}}.csv", method=METHODS, benchmark=BENCHMARKS),
        baselines=expand(f"{RESULTS}/{TARGET}/eval/baseline/{{benchmark}}.json", benchmark=BENCHMARKS),
    output:
        table1=report(f"{RESULTS}/tables/table1.csv", category="Table 1"),
        table1_md=f"{RESULTS}/tables/table1.md",
        fig2_csv=f"{RESULTS}/tables/fig2.csv",
        fig2=report(f"{FIGURES}/fig2.pdf", category="Figure 2"),
        fig2_png=f"{FIGURES}/fig2.png",
        report=f"{RESULTS}/REPORT.md",
    log:
        f"{LOGS}/{TARGET}/report.log",
    shell:
        "python -m deepspec report {CONFIG_ARGS} > {log:q} 2>&1"

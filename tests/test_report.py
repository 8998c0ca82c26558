"""Report assembly on synthetic records with known per-position acceptance."""
import json

import numpy as np
import pandas as pd
import pytest

from deepspec.config import load_config
from deepspec.core.acceptance import summarize_rounds
from deepspec.errors import DeepSpecError
from deepspec.reporting.report import (
    FIG2_COLUMNS,
    FIG2_RB_COLUMNS,
    TABLE1_COLUMNS,
    build_fig2,
    build_table1,
    cli_report,
)
from deepspec.reporting.training_curves import TRAINING_CURVES

RATES = {"dflash": [0.8, 0.6, 0.55, 0.55, 0.5, 0.5, 0.5], "eagle3": [0.5, 0.6, 0.65, 0.7, 0.7, 0.7, 0.7],
         "dspark": [0.85, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]}


def _fake_records(rates, n_samples, rounds, rng):
    """Position k of a round is accepted w.p. a_k, a per-token probability with
    mean alpha_k = rates[k] (uniform around it), as verification records them."""
    c = np.asarray(rates)
    n = n_samples * rounds
    half = np.minimum(c, 1 - c)
    a = c - half + 2 * half * rng.random((n, 7))
    acc = np.cumprod(rng.random((n, 7)) < a, 1).sum(1)
    df = pd.DataFrame({"sample_id": np.repeat(np.arange(n_samples), rounds), "round": np.tile(np.arange(rounds), n_samples),
                       "proposal_len": 7, "accepted": acc, "emitted": acc + 1, "draft_time_s": 0.01, "verify_time_s": 0.02})
    for k in range(7):
        df[f"accept_prob_{k + 1}"], df[f"alpha_{k + 1}"] = a[:, k], c[k]
    return df


def _write_eval(ev, method, bench, df, cfg):
    """Records and evaluate's summary (tau and its CI from the records), as the evaluate rule writes them."""
    (ev / method).mkdir(parents=True, exist_ok=True)
    df.to_csv(ev / method / f"{bench}.csv", index=False)
    s = summarize_rounds(df, n_boot=cfg["eval"]["n_boot"], seed=cfg["eval"]["seed"])
    s.update(n_samples_with_rounds=s["n_samples"], tokens_per_s=20.0)
    (ev / method / f"{bench}.json").write_text(json.dumps(s))


@pytest.fixture
def fake_results(tmp_path):
    cfg = load_config("tiny", {"results_dir": str(tmp_path / "results"), "figures_dir": str(tmp_path / "figures")})
    rng = np.random.default_rng(0)
    ev = tmp_path / "results" / "tiny" / "eval"
    for bench in cfg["data"]["benchmarks"]:
        for m, r in RATES.items():
            _write_eval(ev, m, bench, _fake_records(r, 80, 30, rng), cfg)
        (ev / "baseline").mkdir(exist_ok=True)
        (ev / "baseline" / f"{bench}.json").write_text(json.dumps({"plain": {"tokens_per_s": 10.0}, "prompt_lookup": {"tokens_per_s": 12.0}}))
    return cfg, tmp_path


def test_table1_and_fig2(fake_results):
    cfg, _ = fake_results
    t1 = build_table1(cfg)
    assert list(t1.columns[: len(TABLE1_COLUMNS)]) == TABLE1_COLUMNS
    drafts = t1[t1.method.isin(RATES)]
    assert len(drafts) == 3 * len(cfg['data']['benchmarks']) and (drafts.speedup == 2.0).all()
    assert set(t1.method) == {"dflash", "eagle3", "dspark", "plain", "prompt_lookup"}
    fig2 = build_fig2(cfg)
    assert list(fig2.columns) == FIG2_COLUMNS + FIG2_RB_COLUMNS and len(fig2) == 3 * 3 * 7
    for m, r in RATES.items():
        got = fig2[(fig2.method == m) & (fig2.domain == "Math")].sort_values("position")
        # 2400 rounds per domain: the conditional rates are recovered, within the intervals.
        assert np.all(np.abs(got.acceptance.to_numpy()[:4] - r[:4]) < 0.05)
        assert np.all(got.ci_low <= got.acceptance) and np.all(got.acceptance <= got.ci_high)
        # The Rao-Blackwellised estimate recovers all seven, with narrower intervals.
        assert np.all(np.abs(got.acceptance_rb.to_numpy() - r) < 0.03)
        assert np.all(got.rb_ci_high - got.rb_ci_low < got.ci_high - got.ci_low)


def test_report_cli_writes_everything(fake_results, monkeypatch):
    cfg, tmp = fake_results
    monkeypatch.chdir(tmp)
    bench = next(iter(cfg["data"]["benchmarks"]))
    for m in RATES:  # a prompt over data.max_prompt_tokens, left out of every method
        js = tmp / "results" / "tiny" / "eval" / m / f"{bench}.json"
        js.write_text(json.dumps(dict(json.loads(js.read_text()), n_skipped_prompts=1)))
    rc = cli_report(["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set", f"figures_dir={tmp / 'figures'}",
                     "--set", "train.max_steps={eagle3: 5, dflash: 9}"])
    assert rc == 0
    assert (tmp / "figures" / "fig2.pdf").read_bytes()[:5] == b"%PDF-"
    assert (tmp / "figures" / "fig2.png").stat().st_size > 1000
    report = (tmp / "results" / "REPORT.md").read_text()
    for name in ("DFlash decay p1 > p3", "DSpark > DFlash at p2, p3", "DSpark tau > DFlash", "DSpark tau > Eagle3",
                 "p1 >= 0.3", "Eagle3 low at p1, then flat/rising"):
        assert f"**{name}: holds.**" in report, name
    assert "Estimator: the Rao-Blackwellised estimate" in report and "Rao-Blackwellised estimate (every" in report
    # the setup as run: the step caps beside the epochs, the prompts left out
    assert "or max_steps eagle3 5, dflash 9, whichever ends first" in report
    assert f"Left out, over data.max_prompt_tokens: 1 of {bench}" in report
    # the widest interval is a judged point's, named with its own attempts; unjudged half-widths are blank
    import re

    widest = re.search(r"Widest 95 % half-interval among the judged points \(at least 30 expected attempts\): "
                       r"±([\d.]+), (\w+) (\w+) position (\d) \(([\d.]+) expected attempts\)", report)
    assert widest and float(widest.group(5)) >= 30, report
    md = (tmp / "results" / "tables" / "table1.md").read_text()
    assert "| DSpark |" in md
    # the paper's macro gains, computed from its Table 1 (paper.py), not typed in
    assert "paper, Qwen3-4B: +16.3 %)" in report and "paper, Qwen3-4B: +30.9 %)" in report


def _write_train_log(cfg, method, steps):
    """A train_log.csv where the train rule writes it: the loss falling, c*_1 and the
    expected tau rising over `steps` logged steps."""
    from deepspec.paths import RunPaths

    d = RunPaths.of(cfg).drafter_dir(method)
    d.mkdir(parents=True, exist_ok=True)
    step = np.arange(1, steps + 1)
    pd.DataFrame({"step": step, "epoch": step / steps, "lr": 6e-4, "loss": 6.0 / np.sqrt(step), "loss_ce": 5.0,
                  "c_star_1": 0.8 - 0.6 / step, "tau_expected": 3.0 - 2.0 / step, "grad_norm": 1.0,
                  "positions_per_s": 100.0, "sequences_per_s": 2.0, "elapsed_s": step * 0.5}
                 ).to_csv(d / "train_log.csv", index=False)


def test_training_figure_and_section(fake_results, monkeypatch, caplog):
    """figures/training.pdf / .png: the loss, c*_1 and the expected tau of each
    trained drafter against the step, one line per drafter; REPORT.md links it
    (relative to itself), says they are training-batch values, gives each drafter's
    first and last values and the TensorBoard directory. A released checkpoint
    (eval.released_checkpoints: nothing trained, no train_log) has no line and is
    named as such; with no log at all the figure is still written, with a warning."""
    from deepspec.reporting import report as R

    cfg, tmp = fake_results
    monkeypatch.chdir(tmp)
    drawn = []
    save = R.save_figure
    from deepspec.reporting import training_curves

    monkeypatch.setattr(training_curves, "save_figure",
                        lambda fig, *paths, **kw: (drawn.append(fig), save(fig, *paths, **kw)))
    for m, steps in (("eagle3", 40), ("dspark", 25)):
        _write_train_log(cfg, m, steps)
    s = ["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set", f"figures_dir={tmp / 'figures'}"]
    assert cli_report(s + ["--set", "eval.released_checkpoints.dflash=released/dflash_block7"]) == 0
    assert (tmp / "figures" / "training.pdf").read_bytes()[:5] == b"%PDF-"
    assert (tmp / "figures" / "training.png").stat().st_size > 1000
    training = drawn[-1]
    assert [ax.get_title() for ax in training.axes] == [t for _, t in TRAINING_CURVES]
    for ax in training.axes:
        assert [ln.get_label() for ln in ax.get_lines()] == ["Eagle3", "DSpark"]
    assert list(training.axes[0].get_lines()[1].get_xdata()) == list(range(1, 26))

    report = (tmp / "results" / "REPORT.md").read_text()
    section = report.split("## Training\n", 1)[1].split("\n## ", 1)[0]
    assert "![training curves](../figures/training.png)" in section and "training batches" in section
    assert "| Eagle3 | 40 | 6.000 → 0.949 | 0.200 → 0.785 | 1.000 → 2.950 |" in section
    assert "| DSpark | 25 |" in section and "DFlash" not in section
    assert "released checkpoints, eval.released_checkpoints): dflash." in section
    assert f"`tensorboard --logdir {tmp / 'results' / 'tiny' / 'drafters'}`" in section

    # nothing released and no log: no line, one warning per drafter, the figure still written
    for m in ("eagle3", "dspark"):
        (tmp / "results" / "tiny" / "drafters" / m / "train_log.csv").unlink()
    (tmp / "figures" / "training.png").unlink()
    with caplog.at_level("WARNING"):
        assert cli_report(s) == 0
    assert all(not ax.get_lines() for ax in drawn[-1].axes) and (tmp / "figures" / "training.png").exists()
    assert all(f"no training curve for {m}" in caplog.text for m in ("eagle3", "dflash", "dspark"))
    assert "| drafter | steps |" not in (tmp / "results" / "REPORT.md").read_text()


def test_report_refuses_summaries_made_with_other_settings(fake_results):
    """W3: Table 1 with one method re-evaluated at another eval.max_new_tokens (or a
    baseline timed at another temperature) is refused in one line naming the file and
    the key, instead of a table whose rows mix settings under REPORT.md's one line.
    Summaries recording this config's settings pass."""
    from deepspec.evaluation.evaluate import baseline_settings, evaluation_settings

    cfg, tmp = fake_results
    ev = tmp / "results" / "tiny" / "eval"
    other = load_config("tiny", {"results_dir": str(tmp / "results"), "eval": {"max_new_tokens": 12}})
    for m in RATES:
        for b in cfg["data"]["benchmarks"]:
            s = json.loads((ev / m / f"{b}.json").read_text())
            (ev / m / f"{b}.json").write_text(json.dumps(dict(s, settings=evaluation_settings(cfg))))
    for b in cfg["data"]["benchmarks"]:
        s = json.loads((ev / "baseline" / f"{b}.json").read_text())
        (ev / "baseline" / f"{b}.json").write_text(json.dumps(dict(s, settings=baseline_settings(cfg))))
    assert len(build_table1(cfg)) > 0
    dspark = ev / "dspark" / "gsm8k.json"
    good = dspark.read_text()
    dspark.write_text(json.dumps(dict(json.loads(good), settings=evaluation_settings(other))))
    with pytest.raises(DeepSpecError, match=r"dspark/gsm8k.json was made with eval.max_new_tokens = 12, this config "
                                            r"has 16: Table 1 would mix settings") as e:
        build_table1(cfg)
    assert "\n" not in str(e.value)
    # a summary without recorded settings (an older one): its temperature and max_new_tokens
    s = json.loads(good)
    s.pop("settings")
    dspark.write_text(json.dumps(dict(s, max_new_tokens=12, temperature=cfg["eval"]["temperature"])))
    with pytest.raises(DeepSpecError, match="was made with eval.max_new_tokens = 12"):
        build_table1(cfg)
    dspark.write_text(good)
    base = ev / "baseline" / "gsm8k.json"
    hot = load_config("tiny", {"results_dir": str(tmp / "results"), "eval": {"temperature": 0.5}})
    base.write_text(json.dumps(dict(json.loads(base.read_text()), settings=baseline_settings(hot))))
    with pytest.raises(DeepSpecError, match="baseline/gsm8k.json was made with eval.temperature = 0.5"):
        build_table1(cfg)


def test_report_refuses_records_cut_short(fake_results, monkeypatch):
    """A per-round CSV cut in half (the last row cut mid-line): one line naming
    it, since its summary counts twice the rounds; nothing written."""
    cfg, tmp = fake_results
    monkeypatch.chdir(tmp)
    bench = next(iter(cfg["data"]["benchmarks"]))
    csv = tmp / "results" / "tiny" / "eval" / "eagle3" / f"{bench}.csv"
    data = csv.read_bytes()
    csv.write_bytes(data[: len(data) // 2])
    s = ["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set", f"figures_dir={tmp / 'figures'}"]
    with pytest.raises(DeepSpecError, match=rf"{csv}: \d+ rounds, but {bench}\.json beside it counts 2400: the records "
                                            r"are cut short or damaged \(rerun evaluate\)") as e:
        cli_report(s)
    assert "\n" not in str(e.value)
    assert not (tmp / "results" / "tables").exists() and not (tmp / "figures").exists()
    csv.write_bytes(b"")
    with pytest.raises(DeepSpecError, match=rf"{csv}: unreadable per-round records \(No columns to parse"):
        cli_report(s)


def test_report_refuses_damaged_records_and_summaries(fake_results, monkeypatch):
    """Hand-damaged evaluation outputs: a column renamed, a cell that is not a number,
    a summary key removed or not a number: each one line naming the file and the
    column or key, nothing written."""
    import pandas as pd

    cfg, tmp = fake_results
    monkeypatch.chdir(tmp)
    bench = next(iter(cfg["data"]["benchmarks"]))
    csv = tmp / "results" / "tiny" / "eval" / "dspark" / f"{bench}.csv"
    summary = csv.with_suffix(".json")
    good_csv, good_summary = csv.read_bytes(), summary.read_text()
    s = ["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set", f"figures_dir={tmp / 'figures'}"]
    df = pd.read_csv(csv)
    bad_cell = df.astype({"accepted": object, "alpha_2": object})
    bad_cell.loc[3, "alpha_2"] = "x"
    cases = [
        (lambda: df.rename(columns={"accepted": "acc"}).to_csv(csv, index=False), rf"{csv}: no column 'accepted'"),
        (lambda: bad_cell.to_csv(csv, index=False), rf"{csv}: column 'alpha_2' holds 'x' \(line 5\), not a number"),
        (lambda: summary.write_text(json.dumps({k: v for k, v in json.loads(good_summary).items() if k != "tau"})),
         rf"{summary}: no 'tau' \(a damaged evaluation summary\)"),
        (lambda: summary.write_text(json.dumps(dict(json.loads(good_summary), rounds="many"))),
         rf"{summary}: a non-number 'many' as 'rounds'"),
    ]
    for damage, msg in cases:
        csv.write_bytes(good_csv)
        summary.write_text(good_summary)
        damage()
        with pytest.raises(DeepSpecError, match=msg) as e:
            cli_report(s)
        assert "\n" not in str(e.value)
        assert not (tmp / "results" / "tables").exists() and not (tmp / "figures").exists()


def test_paper_macro_gains_come_from_table1():
    from deepspec import paper

    assert paper.macro_gain("Qwen3-4B", "dspark", "dflash") == pytest.approx(42.54 / 36.58 - 1)
    assert round(100 * paper.macro_gain("Qwen3-4B", "dspark", "eagle3"), 1) == 30.9
    assert paper.macro_gain("Gemma4-12B", "dflash", "eagle3") < 0  # Eagle3 leads DFlash on Gemma4


def test_ablation_figures_from_records(fake_results, monkeypatch):
    from deepspec.methods import fig3_methods, fig4_methods, resolve_method
    from deepspec.reporting.ablations import cli_plot

    cfg, tmp = fake_results
    ev = tmp / "results" / "tiny" / "eval"
    rng = np.random.default_rng(1)
    for m in sorted(set(fig3_methods(cfg) + fig4_methods(cfg)) - set(RATES)):
        for bench in cfg["data"]["benchmarks"]:
            _write_eval(ev, m, bench, _fake_records(RATES["dspark"], 5, 5, rng), cfg)
    s = ["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set", f"figures_dir={tmp / 'figures'}"]
    for fig in ["fig3", "fig4"]:
        assert cli_plot([fig, *s]) == 0
        assert (tmp / "figures" / f"{fig}.pdf").read_bytes()[:5] == b"%PDF-"
    f4 = pd.read_csv(tmp / "results" / "tables" / "fig4.csv")
    assert sorted(set(f4.draft_length)) == [4, 8, 12, 16]
    pd.DataFrame({"threshold": [0.0, 0.5], "accepted": [3.0, 2.5], "proposed": [8.0, 4.0], "acceptance_rate": [0.37, 0.62]}
                 ).to_csv(ev / "dspark" / "gsm8k.sweep.csv", index=False)
    pd.DataFrame({"position": [1, 2], "ece_before": [0.08, 0.05], "ece_after": [0.02, 0.01], "auroc": [0.8, 0.85],
                  "n": [100, 80], "temperature": [1.5, 1.2]}).to_csv(ev / "dspark" / "alpaca.calibration.csv", index=False)
    for fig in ["fig5", "fig6"]:
        assert cli_plot([fig, *s]) == 0
    assert resolve_method(cfg, "dspark_rnn-b11")[1]["drafter"]["markov_head_type"] == "rnn"
    assert resolve_method(cfg, "dspark-l1")[1]["drafter"]["num_layers"]["dspark"] == 1
    with pytest.raises(Exception, match="unknown method"):
        resolve_method(cfg, "medusa")


def _noisy_records(rates, n, rounds, rng):
    """`_fake_records` whose alpha_k varies from round to round (as a context's
    acceptance does), mean rates[k]: the Rao-Blackwellised estimate has sampling noise."""
    df = _fake_records(rates, n, rounds, rng)
    for k in range(7):
        df[f"alpha_{k + 1}"] = df[f"accept_prob_{k + 1}"]
    return df


def _records(cfg, rates, rng, n=40, rounds=12):
    domains = {}
    for bench, spec in cfg["data"]["benchmarks"].items():
        domains.setdefault(spec["domain"], []).append(bench)
    return {m: {d: [_noisy_records(r, n, rounds, rng) for _ in benches] for d, benches in domains.items()}
            for m, r in rates.items()}


def test_claims_hold_on_the_papers_shapes_and_fail_on_their_opposite():
    """The claims, judged by intervals of differences: all hold on curves of
    the paper's shapes; with the roles swapped (DSpark decaying below a flat
    DFlash) the decay, stability and tau claims do not; with a too
    small gap the interval covers 0 and the stability claim does not hold."""
    from deepspec.reporting.claims import judge_claims

    cfg = load_config("tiny")
    rng = np.random.default_rng(4)
    ok = {c.name: c for c in judge_claims(_records(cfg, RATES, rng), 7, n_boot=300)[0]}
    assert all(c.holds for c in ok.values()), [c.text for c in ok.values() if not c.holds]
    assert "[+" in ok["DSpark > DFlash at p2, p3"].text  # an interval, not only an estimate
    swapped = dict(RATES, dflash=[0.8] * 7, dspark=RATES["dflash"])
    bad = {c.name: c.holds for c in judge_claims(_records(cfg, swapped, rng), 7, n_boot=300)[0]}
    assert bad["DFlash decay p1 > p3"] is False and bad["DSpark > DFlash at p2, p3"] is False
    assert bad["DSpark tau > DFlash"] is False
    close = dict(RATES, dspark=[0.8, 0.61, 0.56, 0.55, 0.5, 0.5, 0.5])
    near = {c.name: c.holds for c in judge_claims(_records(cfg, close, rng, n=20, rounds=6), 7, n_boot=300)[0]}
    assert near["DSpark > DFlash at p2, p3"] is False


def test_claims_are_not_judged_without_attempts():
    from deepspec.reporting.claims import judge_claims

    cfg = load_config("tiny")
    low = {m: [0.05] * 7 for m in RATES}  # almost no round reaches position 3
    claims = {c.name: c.holds for c in judge_claims(_records(cfg, low, np.random.default_rng(0), n=5, rounds=4), 7)[0]}
    assert claims["DFlash decay p1 > p3"] is None and claims["DSpark > DFlash at p2, p3"] is None


def test_speed_section_pools_the_interleaved_timings(fake_results, monkeypatch):
    """Each drafter's speedup over the plain decoding timed beside it, pooled over
    the timed benchmarks with a paired interval: faster holds only when the whole
    interval is above 1; DSpark's Algorithm 1 decoding of the same prompts gets its
    own line and table1.csv columns; table1.csv carries each benchmark's interval."""
    from deepspec.data.prompts import speed_benchmarks
    from deepspec.paths import RunPaths

    cfg, tmp = fake_results
    rng = np.random.default_rng(1)
    ratios = {"dspark": 1.4, "dflash": 0.8, "eagle3": 1.0}
    timed = speed_benchmarks(cfg)
    for bench in timed:
        for m, r in ratios.items():
            path = RunPaths.of(cfg).summary(m, bench)
            s = json.loads(path.read_text())
            t = rng.uniform(2, 4, 6)
            s["samples"] = [{"sample_id": f"{bench}-{i}", "new_tokens": 64, "time_s": float(x),
                             "plain_new_tokens": 64, "plain_time_s": float(x * r * rng.uniform(0.97, 1.03))}
                            for i, x in enumerate(t)]
            if m == "dspark":  # Algorithm 1 at 1.1x the fixed-gamma rate, 3 drafts verified per round
                for x in s["samples"]:
                    x.update(alg1_new_tokens=64, alg1_time_s=x["time_s"] / 1.1, alg1_rounds=20, alg1_verified=60)
            from deepspec.evaluation.evaluate import interleaved_speedup

            s["speedup_interleaved"] = interleaved_speedup(s["samples"], 200, 0)
            s["speedup_alg1"] = interleaved_speedup(s["samples"], 200, 0, "alg1")
            s["tokens_per_s"] = sum(x["new_tokens"] for x in s["samples"]) / sum(x["time_s"] for x in s["samples"])
            path.write_text(json.dumps(s))
    monkeypatch.chdir(tmp)
    assert cli_report(["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}",
                       "--set", f"figures_dir={tmp / 'figures'}"]) == 0
    report = (tmp / "results" / "REPORT.md").read_text()
    speed = report.split("## Speed at batch size 1", 1)[1]
    assert "**DSpark (all 7 drafts verified) faster than plain decoding: holds.** 1.4" in speed
    assert "**DSpark (Algorithm 1 choosing the verified length) faster than plain decoding: holds.** 1.5" in speed
    assert "3.00 drafts verified per round" in speed
    assert "**DFlash (all 7 drafts verified) faster than plain decoding: does not hold.** 0.8" in speed
    assert "**Eagle3 (all 7 drafts verified) faster than plain decoding: does not hold.**" in speed
    assert "DFlash (Algorithm 1" not in speed and "Eagle3 (Algorithm 1" not in speed
    assert f"over {6 * len(timed)} prompts" in speed and f"stratified over {len(timed)} strata bootstrap" in speed
    t1 = pd.read_csv(tmp / "results" / "tables" / "table1.csv")
    # counts written as integers, empty on the drafter-free baselines' rows
    raw = pd.read_csv(tmp / "results" / "tables" / "table1.csv", dtype=str)
    assert raw[raw.method == "plain"]["n_samples"].isna().all() and (raw.method == "plain").any()
    for col in ("n_samples", "rounds", "skipped_prompts"):
        assert raw[col].dropna().str.fullmatch(r"\d+").all(), raw[col].tolist()
    row = t1[(t1.method == "dspark") & (t1.benchmark == timed[0])].iloc[0]
    assert row.speedup_ci_low <= row.speedup <= row.speedup_ci_high and row.speedup == pytest.approx(1.4, rel=0.05)
    assert row.speedup_alg1_ci_low <= row.speedup_alg1 <= row.speedup_alg1_ci_high
    assert row.speedup_alg1 == pytest.approx(1.54, rel=0.05)
    assert t1[t1.method == "dflash"].speedup_alg1.isna().all()
    assert "(Algorithm 1: 1.5" in report.split("## Table 1", 1)[1].split("Macro means", 1)[0]
    # each row's speedup is its tokens/s over the plain decoding it was timed against (a drafter's: timed
    # beside it in its evaluation; the baselines': the baseline job's)
    timed_rows = t1[t1.tokens_per_s.notna() & t1.method.isin(ratios)]
    assert len(timed_rows) and np.allclose(timed_rows.speedup, timed_rows.tokens_per_s / timed_rows.plain_tokens_per_s)
    base = t1[t1.method == "prompt_lookup"]
    assert np.allclose(base.speedup, base.tokens_per_s / base.plain_tokens_per_s)
    # one timed prompt in all: its ratio, not judged, no interval
    for m in ratios:
        path = RunPaths.of(cfg).summary(m, timed[0])
        s = json.loads(path.read_text())
        s["samples"] = s["samples"][:1]
        s["speedup_interleaved"] = interleaved_speedup(s["samples"], 200, 0)
        s["speedup_alg1"] = interleaved_speedup(s["samples"], 200, 0, "alg1")
        path.write_text(json.dumps(s, allow_nan=True))
    assert cli_report(["--preset", "tiny", "--set", f"results_dir={tmp / 'results'}", "--set",
                       f"figures_dir={tmp / 'figures'}", "--set", f"eval.speed_benchmarks=[{timed[0]}]"]) == 0
    speed = (tmp / "results" / "REPORT.md").read_text().split("## Speed at batch size 1", 1)[1]
    assert "**DSpark (all 7 drafts verified) faster than plain decoding: not judged** (1 timed prompt: a bootstrap" in speed
    assert "holds" not in speed


def test_compare_runs_pairs_two_runs_over_the_same_prompts():
    """benchmarks/compare_runs.py: a run against itself differs by exactly 0; a run
    whose DFlash accepts more at position 1 shows it, its interval above 0."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "compare_runs.py"
    spec = importlib.util.spec_from_file_location("compare_runs", path)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    cfg = load_config("tiny")
    rates = {"dflash": RATES["dflash"]}
    a = _records(cfg, rates, np.random.default_rng(0))
    same = cr.compare(a, a, n_boot=200)
    assert {r["quantity"] for r in same} >= {"macro tau", "Math p1", "Chat p3"}
    assert all(r["diff"] == r["low"] == r["high"] == 0 for r in same)
    better = _records(cfg, {"dflash": [RATES["dflash"][0] + 0.2, *RATES["dflash"][1:]]}, np.random.default_rng(1))
    rows = {r["quantity"]: r for r in cr.compare(a, better, n_boot=200)}
    assert all(rows[f"{d} p1"]["low"] > 0.1 for d in ("Math", "Code", "Chat")), rows
    assert rows["macro tau"]["low"] > 0


def test_speed_scope_counts_what_was_timed():
    """The report says how many prompts were timed: a benchmark capped below
    eval.speed_prompts times all it has (the rehearsals: 1 of GSM8K, not 2)."""
    from deepspec.config import load_config
    from deepspec.reporting.report import _speed_scope
    from deepspec.settings import Settings

    def scope(preset, over=None):
        return _speed_scope(Settings.of(load_config(preset, over)))

    assert scope("rehearsal-qwen3") == "timed on the first prompt of GSM8K"
    assert scope("qwen3-4b") == "timed on the first 2 prompts of every benchmark"
    assert scope("tiny", {"eval": {"speed_prompts": 2}, "data": {"benchmarks": {"gsm8k": {"cap": 1}}}}) == \
        "timed on the first 1 of GSM8K, 2 of MT-Bench prompts"

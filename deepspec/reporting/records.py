"""evaluate's outputs as the report reads them (`deepspec.paths`): each
benchmark's summary JSON and per-round records, checked for the settings they
were made with and for damage, each problem one line naming the file."""
from __future__ import annotations

import pandas as pd

from ..errors import DeepSpecError
from ..files import json_safe, read_json_object, require_file
from ..paths import RunPaths
from ..settings import Settings

_RUN_EVALUATE = " (run the evaluate rule first)"


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def check_settings(cfg, summary: dict, path, rule: str) -> None:
    """Refuse, in one line, an evaluation (rule "evaluate") or baseline summary made
    with other settings than `cfg`'s (a config or its Settings), which Table 1 and
    REPORT.md state: e.g. one method re-evaluated with another eval.max_new_tokens.
    The summary records its settings (evaluation.evaluate.evaluation_settings /
    baseline_settings); one without them is checked on the temperature and
    max_new_tokens it records."""
    from ..evaluation.evaluate import baseline_settings, evaluation_settings

    s = Settings.view(cfg)
    want = evaluation_settings(s) if rule == "evaluate" else baseline_settings(s)
    got = summary.get("settings")
    if got is None:
        want = {f"eval.{k}": getattr(s.eval, k) for k in ("temperature", "max_new_tokens") if k in summary}
        got = {f"eval.{k}": summary[k] for k in ("temperature", "max_new_tokens") if k in summary}
    want, got = dict(_flat(json_safe(want))), dict(_flat(got))
    for key in sorted(set(want) | set(got)):
        if want.get(key, "(unset)") != got.get(key, "(unset)"):
            raise DeepSpecError(f"{path} was made with {key} = {got.get(key, '(unset)')}, this config has "
                                f"{want.get(key, '(unset)')}: Table 1 would mix settings; rerun it "
                                f"(snakemake --forcerun {rule})")


def load_records(cfg) -> dict[str, dict[str, list[pd.DataFrame]]]:
    """Per method and domain, the per-round records of the domain's benchmarks
    (in the preset's order, the same for every method). `cfg`: a config or its Settings."""
    s = Settings.view(cfg)
    paths = RunPaths.of(s)
    domains: dict[str, list[str]] = {}
    for bench, spec in s.data.benchmarks.items():
        domains.setdefault(spec["domain"], []).append(bench)
    return {m: {d: [read_records(paths, m, b) for b in benches] for d, benches in domains.items()}
            for m in s.train.methods}


# What Table 1 and Figure 2 read of evaluate's outputs: the summary's numbers (None where
# undefined, e.g. tau without rounds) and the records' columns besides the per-position ones
SUMMARY_NUMBERS = ("n_samples_with_rounds", "rounds", "tau", "tau_ci_low", "tau_ci_high", "verify_rate",
                   "tau_selfcheck")
RECORD_NUMBERS = ("proposal_len", "accepted", "emitted")
PER_POSITION = ("conf_logit_", "accept_prob_", "alpha_")


def read_summary(paths: RunPaths, method: str, bench: str) -> dict:
    """evaluate's summary of one benchmark, with the numbers the report reads; a damaged
    one (a key missing, a value not a number) is one line naming the file and the key."""
    path = paths.summary(method, bench)
    s = read_json_object(require_file(path, "evaluation output", _RUN_EVALUATE), "an evaluation summary")
    for key in SUMMARY_NUMBERS:
        v = s.get(key, "missing")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            what = "no" if v == "missing" else f"a non-number {v!r} as"
            raise DeepSpecError(f"{path}: {what} '{key}' (a damaged evaluation summary): rerun evaluate")
    return s


def read_records(paths: RunPaths, method: str, bench: str) -> pd.DataFrame:
    """evaluate's per-round records of one benchmark, as many rows as its
    summary counts rounds: records cut short or damaged would otherwise give
    Figure 2 fewer rounds than Table 1 (read from the summary) without a word.
    A column the report reads that is missing or holds a non-number is one line."""
    csv = require_file(paths.records(method, bench), "evaluation output", _RUN_EVALUATE)
    summary = paths.summary(method, bench)
    rounds = read_summary(paths, method, bench)["rounds"]
    try:
        df = pd.read_csv(csv)
    except (ValueError, UnicodeDecodeError) as e:  # pandas' ParserError and EmptyDataError are ValueErrors
        raise DeepSpecError(f"{csv}: unreadable per-round records ({str(e).strip().splitlines()[0]}): "
                            "rerun evaluate") from None
    for col in ("sample_id", *RECORD_NUMBERS):
        if col not in df.columns:
            raise DeepSpecError(f"{csv}: no column '{col}' (damaged per-round records): rerun evaluate")
    for col in [*RECORD_NUMBERS, *(c for c in df.columns if c.startswith(PER_POSITION))]:
        if not pd.api.types.is_numeric_dtype(df[col]):
            bad = df[col][pd.to_numeric(df[col], errors="coerce").isna() & df[col].notna()]
            raise DeepSpecError(f"{csv}: column '{col}' holds {bad.iloc[0]!r} (line {bad.index[0] + 2}), "
                                "not a number (damaged per-round records): rerun evaluate")
    if len(df) != rounds:
        raise DeepSpecError(f"{csv}: {len(df)} rounds, but {summary.name} beside it counts {rounds}: "
                            "the records are cut short or damaged (rerun evaluate)")
    return df

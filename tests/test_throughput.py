"""The throughput and fig7 CLIs (deepspec/evaluation/throughput.py) on the tiny target,
with an untrained DSpark drafter saved where the DAG's train rule puts it."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from deepspec.evaluation.throughput import COLUMNS, best_threshold, cli_fig7, cli_throughput

pytestmark = pytest.mark.usefixtures("one_thread")  # timing-sensitive decoding: one torch thread


def test_throughput_table_and_fig7(tmp_path, tiny_cfg, tiny_target, shared_data):
    from deepspec import drafters

    with torch.random.fork_rng():
        torch.manual_seed(0)
        drafters.build_drafter("dspark", tiny_target, tiny_cfg).save_pretrained(tmp_path / "tiny/drafters/dspark")
    args = ["--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
            "--set", f"data.root={tiny_cfg['data']['root']}", "--set", f"results_dir={tmp_path}"]
    csv = tmp_path / "throughput.csv"
    policies = ["--set", "throughput.policies=[plain, fixed, threshold, alg1, alg1-padded]"]
    assert cli_throughput(args + policies + ["--out", str(csv)]) == 0
    df = pd.read_csv(csv)
    assert list(df.columns) == COLUMNS
    assert list(df["policy"].unique()) == ["plain", "fixed", "threshold=0.5", "alg1", "alg1-padded"]
    assert sorted(df["concurrency"].unique()) == [1, 2] and (df["requests"] == 4).all()
    assert (df["tokens_per_s"] > 0).all() and (df["new_tokens"] <= 4 * 8).all()
    plain, fixed = df[df.policy == "plain"], df[df.policy == "fixed"]
    assert (plain["mean_verify_len"] == 0).all() and (plain["tau"] == 1).all() and (fixed["mean_verify_len"] == 7).all()
    assert set(best_threshold(df)["policy"]) == {"plain", "fixed", "threshold (best)", "alg1", "alg1-padded"}
    assert cli_fig7(args + ["--csv", str(csv), "--pdf", str(tmp_path / "fig7.pdf"), "--png", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "fig7.pdf").stat().st_size > 0

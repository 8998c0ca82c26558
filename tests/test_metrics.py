import time

import numpy as np
import pandas as pd
import pytest
import torch

from deepspec.metrics import confidence_selfcheck, position_table, summarize_rounds
from deepspec.sampling import expected_tau


def _records(rows, gamma=None, logits=None):
    df = pd.DataFrame(rows, columns=["sample_id", "round", "proposal_len", "accepted", "emitted"])
    df["draft_time_s"] = 0.01
    df["verify_time_s"] = 0.02
    if gamma is not None:
        lg = np.full((len(df), gamma), np.nan) if logits is None else np.asarray(logits, float)
        for k in range(gamma):
            df[f"conf_logit_{k + 1}"] = lg[:, k]
    return df


HAND = [  # sample, round, L, A, emitted
    (0, 0, 3, 3, 4),
    (0, 1, 3, 1, 2),
    (1, 0, 3, 0, 1),
    (1, 1, 3, 2, 3),
]


def _simulate(c, n_samples, n_rounds, seed):
    """Full-length proposals; position k accepted w.p. c_k given the prefix."""
    rng = np.random.default_rng(seed)
    g = len(c)
    n = n_samples * n_rounds
    ok = rng.random((n, g)) < np.asarray(c)[None, :]
    acc = np.where(ok.all(1), g, (~ok).argmax(1))
    sid = np.repeat(np.arange(n_samples), n_rounds)
    rnd = np.tile(np.arange(n_rounds), n_samples)
    return _records(np.stack([sid, rnd, np.full(n, g), acc, acc + 1], 1), gamma=g)


def test_summarize_hand_made():
    s = summarize_rounds(_records(HAND), n_boot=500)
    assert s["n_samples"] == 2 and s["rounds"] == 4
    assert s["tau"] == pytest.approx(2.5)
    assert s["verify_rate"] == pytest.approx(10 / 16)
    assert s["draft_accept_rate"] == pytest.approx(6 / 12)
    # conditional rates 3/4, 2/3, 1/2 -> 1 + .75 + .5 + .25
    assert s["tau_selfcheck"] == pytest.approx(2.5)
    # per-sample means are 3 and 2: every resample lies in [2, 3] and both extremes occur
    assert s["tau_ci_low"] == pytest.approx(2.0) and s["tau_ci_high"] == pytest.approx(3.0)
    assert s["mean_draft_time_s"] == pytest.approx(0.01)
    assert s["mean_verify_time_s"] == pytest.approx(0.02)


def test_eos_round_counts_emitted_not_accepted():
    rows = HAND + [(1, 2, 3, 2, 2)]  # accepted EOS at position 2: no bonus
    s = summarize_rounds(_records(rows), n_boot=50)
    assert s["tau"] == pytest.approx(12 / 5)
    assert s["verify_rate"] == pytest.approx(12 / 20)


def test_position_table_hand_made():
    t = position_table(_records(HAND), n_boot=500)
    assert list(t["position"]) == [1, 2, 3]
    assert list(t["attempts"]) == [4, 3, 2]
    assert list(t["accepted"]) == [3, 2, 1]
    np.testing.assert_allclose(t["acceptance"], [0.75, 2 / 3, 0.5])
    np.testing.assert_allclose(t["survival"], [0.75, 0.5, 0.25])
    # sample 0 accepts position 1 in 2/2 attempts, sample 1 in 1/2
    assert t["ci_low"][0] == pytest.approx(0.5) and t["ci_high"][0] == pytest.approx(1.0)
    assert (t["ci_low"] <= t["acceptance"]).all() and (t["acceptance"] <= t["ci_high"]).all()


def test_position_table_gamma_pads_unreached_positions():
    t = position_table(_records(HAND), gamma=5, n_boot=20)
    assert len(t) == 5
    assert t["attempts"].iloc[3] == 0 and np.isnan(t["acceptance"].iloc[3])


def test_selfcheck_identity_on_synthetic_rounds():
    c = [0.9, 0.8, 0.7, 0.6, 0.5]
    truth = float(expected_tau(torch.tensor(c, dtype=torch.float64)))
    df = _simulate(c, n_samples=300, n_rounds=20, seed=1)
    s = summarize_rounds(df, n_boot=1000, seed=0)
    se = df["emitted"].std() / np.sqrt(len(df))
    assert abs(s["tau"] - truth) < 4 * se
    # full proposals, no EOS: the telescoping identity is exact
    assert s["tau_selfcheck"] == pytest.approx(s["tau"], abs=1e-12)
    assert s["tau_ci_low"] < truth < s["tau_ci_high"]
    assert s["tau_ci_high"] - s["tau_ci_low"] < 12 * se
    t = position_table(df, n_boot=1000)
    assert ((t["ci_low"] < c) & (np.asarray(c) < t["ci_high"])).all()
    np.testing.assert_allclose(t["acceptance"], c, atol=0.03)


def test_selfcheck_breaks_when_proposals_are_truncated():
    # A truncated proposal hides later positions: the identity no longer holds exactly.
    df = _records([(0, 0, 1, 1, 2), (0, 1, 3, 0, 1), (1, 0, 3, 3, 4)])
    s = summarize_rounds(df, n_boot=10)
    assert s["tau"] == pytest.approx(7 / 3)
    # c = (2/3, 1/1, 1/1): the round truncated at 1 never attempts position 2
    assert s["tau_selfcheck"] == pytest.approx(1 + 3 * (2 / 3))
    assert s["tau_selfcheck"] != pytest.approx(s["tau"])


def test_bootstrap_is_fast():
    df = _simulate([0.8] * 7, n_samples=300, n_rounds=30, seed=2)
    t0 = time.perf_counter()
    summarize_rounds(df, n_boot=1000)
    position_table(df, n_boot=1000)
    assert time.perf_counter() - t0 < 2.0


def test_confidence_selfcheck():
    c = np.array([0.9, 0.8, 0.7, 0.6])
    df = _simulate(c, n_samples=200, n_rounds=20, seed=3)
    logit = np.log(c / (1 - c))
    for k in range(4):
        df[f"conf_logit_{k + 1}"] = logit[k]
    out = confidence_selfcheck(df)
    truth = float(expected_tau(torch.tensor(c)))
    assert out["predicted_tau"] == pytest.approx(truth, abs=1e-9)
    assert out["measured_tau"] == pytest.approx(df["emitted"].mean())
    assert abs(out["measured_tau"] - truth) < 0.1
    assert out["n_rounds"] == len(df)


def test_confidence_selfcheck_respects_proposal_len_and_nan():
    rows = [(0, 0, 2, 1, 2), (0, 1, 3, 0, 1)]
    lg = np.array([[0.0, 0.0, np.nan], [0.0, 0.0, 0.0]])
    out = confidence_selfcheck(_records(rows, gamma=3, logits=lg))
    # round 1: 1 + .5 + .25; round 2: 1 + .5 + .25 + .125
    assert out["predicted_tau"] == pytest.approx((1.75 + 1.875) / 2)
    nan = confidence_selfcheck(_records(rows, gamma=3))
    assert np.isnan(nan["predicted_tau"]) and nan["n_rounds"] == 0

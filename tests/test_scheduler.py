import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from deepspec.core.acceptance import summarize_rounds
from deepspec.core.calibration import apply_sts, auroc, calibration_table, ece, fit_sts
from deepspec.core.scheduler import (
    SPSCurve,
    profile_sps,
    schedule_prefix,
    simulate_schedule,
    threshold_sweep,
    truncate_by_threshold,
)


def _logit(p):
    p = np.asarray(p, float)
    return np.log(p / (1 - p))


def _chain(q, rng):
    """Accepted count of a full proposal whose position k passes w.p. q[:, k] given the prefix."""
    ok = rng.random(q.shape) < q
    return np.where(ok.all(1), q.shape[1], (~ok).argmax(1))


# ----------------------------------------------------------------- truncation / sweep
def test_truncate_by_threshold_numpy_and_torch():
    p = np.array([[0.9, 0.5, 0.95], [0.2, 0.9, 0.9], [0.7, 0.7, 0.7]])
    np.testing.assert_array_equal(truncate_by_threshold(p, 0.6), [1, 0, 3])
    np.testing.assert_array_equal(truncate_by_threshold(p, 0.0), [3, 3, 3])
    np.testing.assert_array_equal(truncate_by_threshold(p, 0.75), [1, 0, 0])
    t = truncate_by_threshold(torch.tensor(p), 0.6)
    assert isinstance(t, torch.Tensor) and t.tolist() == [1, 0, 3]
    assert truncate_by_threshold(torch.tensor(p), 0.0).tolist() == [3, 3, 3]


def _sweep_records(n=3000, g=7, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 1.5, (n, g))
    acc = _chain(1 / (1 + np.exp(-z)), rng)
    df = pd.DataFrame({"sample_id": np.arange(n) // 10, "round": np.arange(n) % 10,
                       "proposal_len": g, "accepted": acc, "emitted": acc + 1})
    for k in range(g):
        df[f"conf_logit_{k + 1}"] = z[:, k]
    return df


def test_threshold_sweep_hand_made():
    df = pd.DataFrame({"sample_id": [0, 0], "round": [0, 1], "proposal_len": [3, 3],
                       "accepted": [2, 2], "emitted": [3, 2]})  # round 1 ends on an accepted EOS
    for k, p in enumerate([0.9, 0.5, 0.95]):
        df[f"conf_logit_{k + 1}"] = _logit(p)
    sw = threshold_sweep(df, thresholds=[0.0, 0.6, 0.99])
    # thr 0: accepted (3 + 2) / 2, proposed 4; thr .6: L'=1 -> accepted' 1 + bonus in both rounds
    np.testing.assert_allclose(sw["accepted"], [2.5, 2.0, 1.0])
    np.testing.assert_allclose(sw["proposed"], [4.0, 2.0, 1.0])
    np.testing.assert_allclose(sw["acceptance_rate"], [5 / 8, 1.0, 1.0])


def test_threshold_sweep_matches_measured_tau_and_is_monotone():
    df = _sweep_records()
    sw = threshold_sweep(df)
    s = summarize_rounds(df, n_boot=10)
    assert sw["threshold"].tolist() == pytest.approx(list(np.arange(10) / 10))
    assert sw["accepted"].iloc[0] == pytest.approx(s["tau"])
    assert sw["acceptance_rate"].iloc[0] == pytest.approx(s["verify_rate"])
    assert (np.diff(sw["proposed"]) <= 1e-12).all()
    assert (np.diff(sw["accepted"]) <= 1e-12).all()
    assert sw["proposed"].iloc[-1] < sw["proposed"].iloc[0]
    assert sw["acceptance_rate"].iloc[-1] > sw["acceptance_rate"].iloc[0]
    assert (sw["accepted"] <= sw["proposed"]).all()


# ----------------------------------------------------------------- ECE / AUROC
def test_ece_hand_computed():
    # bin of 0.1: |0.1 - 0.5| * 2/4; bin of 0.9: |0.9 - 1| * 2/4
    assert ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx(0.25)
    assert ece([0.5, 0.5], [0, 1]) == pytest.approx(0.0)
    assert ece([1.0, 0.0], [1, 0]) == pytest.approx(0.0)  # endpoints fall in the edge bins
    # with 2 bins, 0.2 and 0.4 share a bin: |0.3 - 0.5| * 2/3 + |0.9 - 1| * 1/3
    assert ece([0.2, 0.4, 0.9], [0, 1, 1], n_bins=2) == pytest.approx(0.2 * 2 / 3 + 0.1 / 3)


def test_auroc_hand_and_ties():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert auroc([0.2, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx((1 + 1 + 0.5 + 1) / 4)
    assert np.isnan(auroc([0.1, 0.2], [1, 1]))


def test_auroc_matches_bruteforce_pairs():
    rng = np.random.default_rng(5)
    for _ in range(5):
        p = np.round(rng.random(60), 1)  # many ties
        y = rng.random(60) < p
        pos, neg = p[y], p[~y]
        brute = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
        assert auroc(p, y) == pytest.approx(brute)


def test_calibration_table_counts_and_values():
    x = np.array([[2.0, 0.0], [0.0, -1.0], [1.0, 3.0]])
    acc = np.array([2, 0, 1])
    L = np.array([2, 2, 1])
    t = calibration_table(x, acc, L)
    assert t["n"].tolist() == [3, 2]
    s1 = 1 / (1 + np.exp(-x[:, 0]))
    assert t["ece"][0] == pytest.approx(ece(s1, acc >= 1))
    assert t["auroc"][0] == pytest.approx(auroc(s1, acc >= 1))
    surv2 = (s1 * 1 / (1 + np.exp(-x[:, 1])))[:2]
    assert t["mean_pred"][1] == pytest.approx(surv2.mean())
    assert t["mean_label"][1] == pytest.approx(0.5)


# ----------------------------------------------------------------- STS
@pytest.mark.parametrize("scale", [3.0, 0.3])
def test_sts_lowers_heldout_ece(scale):
    rng = np.random.default_rng(11)
    n, g = 8000, 5
    z = rng.normal(1.0, 1.5, (n, g))
    acc = _chain(1 / (1 + np.exp(-z)), rng)
    x, L = scale * z, np.full(n, g)
    temps = fit_sts(x[: n // 2], acc[: n // 2], L[: n // 2])
    assert temps.shape == (g,)
    assert np.all(np.abs(np.log(temps / scale)) < np.log(1.5))  # recovers T ~ scale
    before = calibration_table(x[n // 2:], acc[n // 2:], L[n // 2:])
    after = calibration_table(x[n // 2:], acc[n // 2:], L[n // 2:], temperatures=temps)
    assert (after["ece"] < 0.5 * before["ece"]).all()
    assert (after["ece"] < 0.03).all()
    assert after["auroc"][0] == pytest.approx(before["auroc"][0])  # order-preserving at k=1


def test_sts_is_sequential_and_apply_sts():
    # Position 2 is perfectly calibrated only given position 1's temperature.
    x = np.array([[0.0, 1.0]])
    np.testing.assert_allclose(apply_sts(x, [1.0, 2.0]), [[0.5, 1 / (1 + np.exp(-0.5))]])
    rng = np.random.default_rng(4)
    n = 6000
    z = rng.normal(0.5, 1.0, (n, 2))
    acc = _chain(1 / (1 + np.exp(-z)), rng)
    x = np.stack([4 * z[:, 0], z[:, 1]], 1)  # only position 1 is miscalibrated
    temps = fit_sts(x, acc, np.full(n, 2))
    assert temps[0] == pytest.approx(4.0, rel=0.3)
    assert temps[1] == pytest.approx(1.0, rel=0.3)


# ----------------------------------------------------------------- Algorithm 1
APPENDIX_SPS = {1: 1.0, 2: 0.5, 3: 0.45}


@pytest.mark.parametrize("c2", [0.9, 0.0])
def test_appendix_a_early_stop_ignores_the_future(c2):
    ell, theta = schedule_prefix([[0.8, c2]], APPENDIX_SPS, early_stop=True)
    assert ell.tolist() == [0] and theta == pytest.approx(1.0)


def test_appendix_a_retrospective_depends_on_the_future():
    ell, theta = schedule_prefix([[0.8, 0.9]], APPENDIX_SPS, early_stop=False)
    assert ell.tolist() == [2] and theta == pytest.approx(2.52 * 0.45)
    ell, theta = schedule_prefix([[0.8, 0.0]], APPENDIX_SPS, early_stop=False)
    assert ell.tolist() == [0] and theta == pytest.approx(1.0)


def test_alg1_picks_partial_lengths():
    sps = lambda B: 1.0 if B <= 3 else 0.5  # noqa: E731
    ell, theta = schedule_prefix([[0.9, 0.8], [0.5, 0.1]], sps)
    # order 0.9 (r0), 0.72 (r0), 0.5 (r1), ...: Θ 2 -> 2.9 -> 3.62*0.5 stops
    assert ell.tolist() == [1, 0] and theta == pytest.approx(2.9)


def test_alg1_flat_sps_takes_every_positive_prefix():
    c = np.array([[0.9, 0.8, 0.7], [0.5, 0.0, 0.9], [0.0, 0.9, 0.9], [1.0, 1.0, 1.0]])
    ell, theta = schedule_prefix(c, np.ones(20))
    assert ell.tolist() == [3, 1, 0, 3]
    a = np.cumprod(c, 1)
    assert theta == pytest.approx(4 + a.sum())


def _theta(c, ell, sps):
    a = np.cumprod(c, 1)
    tau = len(c) + sum(a[r, :l].sum() for r, l in enumerate(ell))
    return tau * sps[len(c) + int(np.sum(ell))]


def test_alg1_bruteforce_small_instances():
    rng = np.random.default_rng(0)
    for _ in range(60):
        R, g = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = rng.random((R, g)) * (rng.random((R, g)) > 0.15)
        sps = np.sort(rng.random(R * (g + 1) + 1))[::-1] * (1 + 0.3 * rng.random(R * (g + 1) + 1))  # jagged
        ell_es, th_es = schedule_prefix(c, sps, early_stop=True)
        ell_all, th_all = schedule_prefix(c, sps, early_stop=False)
        # exhaustive over every length vector that stays within a > 0 (the set E of Alg. 1);
        # padding with a = 0 tokens is excluded (it could only exploit a jagged SPS)
        npos = (np.cumprod(c, 1) > 0).sum(1)
        best = max(_theta(c, l, sps) for l in itertools.product(*[range(m + 1) for m in npos]))
        assert th_all == pytest.approx(best)  # exact optimum
        assert th_all == pytest.approx(_theta(c, ell_all, sps))
        assert th_es == pytest.approx(_theta(c, ell_es, sps))
        assert R * sps[R] - 1e-12 <= th_es <= th_all + 1e-12
        # greedy path values: if they are unimodal, early stop is optimal too
        a = np.cumprod(c, 1)
        vals = np.sort(a[a > 0])[::-1]
        path = (R + np.concatenate([[0], np.cumsum(vals)])) * sps[R + np.arange(vals.size + 1)]
        peak = int(np.argmax(path))
        if np.all(np.diff(path[: peak + 1]) > 0) and np.all(np.diff(path[peak:]) <= 0):
            assert th_es == pytest.approx(best)


# ----------------------------------------------------------------- SPS curve / simulation
def test_sps_curve_interp_hold_and_csv(tmp_path):
    curve = SPSCurve(np.array([8, 1, 4]), np.array([2.0, 10.0, 6.0]))
    assert curve(1) == pytest.approx(10.0)
    assert curve(2.5) == pytest.approx(8.0)
    assert curve(6) == pytest.approx(4.0)
    assert curve(100) == pytest.approx(2.0) and curve(0) == pytest.approx(10.0)
    np.testing.assert_allclose(curve(np.array([1, 8])), [10.0, 2.0])
    curve.to_csv(tmp_path / "sps.csv")
    back = SPSCurve.from_csv(tmp_path / "sps.csv")
    np.testing.assert_allclose(back.batch_tokens, [1, 4, 8])
    np.testing.assert_allclose(back.steps_per_s, [10.0, 6.0, 2.0])
    ell, _ = schedule_prefix([[0.8, 0.9]], back)  # usable as the scheduler's SPS
    assert ell.shape == (1,)


def test_profile_sps_times_forward():
    import time

    calls = []

    def fwd(B):
        calls.append(B)
        time.sleep(0.002 * B)

    curve = profile_sps(fwd, [1, 6], n_warmup=1, n_iter=2)
    assert calls == [1, 1, 1, 6, 6, 6]
    assert curve(1) > curve(6) > 0
    assert curve(6) < 1 / 0.012 * 1.01


def test_simulate_schedule():
    rng = np.random.default_rng(2)
    n, g, R = 2000, 7, 16
    c = rng.beta(2, 2, (n, g))
    acc = _chain(c, rng)
    flat = simulate_schedule(c, acc, lambda B: 1.0, batch=R)
    assert flat["mean_verify_len"] == pytest.approx(g)
    assert flat["theta_alg1"] == pytest.approx(flat["theta_fixed"])
    assert flat["n_steps"] == n // R
    compute_bound = lambda B: 100.0 / max(B, 32)  # noqa: E731  flat up to 32 tokens, then ~1/B
    out = simulate_schedule(c, acc, compute_bound, batch=R, seed=1)
    assert out["theta_alg1"] > 1.1 * out["theta_fixed"]
    assert out["theta_alg1"] > out["theta_nospec"]
    assert 0 < out["mean_verify_len"] < g
    assert out["mean_batch_tokens"] == pytest.approx(R * (1 + out["mean_verify_len"]))
    assert out["theta_alg1_predicted"] == pytest.approx(out["theta_alg1"], rel=0.05)  # c is calibrated

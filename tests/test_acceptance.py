import time

import numpy as np
import pandas as pd
import pytest
import torch

from deepspec.core.acceptance import confidence_selfcheck, domain_position_table, position_table, summarize_rounds
from deepspec.core.verify import expected_tau


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


def _verified_rounds(n_rounds, gamma=4, V=6, seed=0, per_sample=20):
    """Real chain verification (sampling.verify_chain) of drafts from two kinds of
    context: 'easy' (p_d a mild distortion of p_t) and 'hard' (unrelated
    Dirichlet draws), half the rounds each. Acceptance then depends on the
    context, so the conditional rate at k (given 1..k-1 accepted) differs from
    the plain mean of alpha_k. Returns the records and the exact conditional rates."""
    from deepspec.core.verify import acceptance_rate, sample, verify_chain

    g = torch.Generator().manual_seed(seed)
    dirichlet = lambda *s: (lambda x: x / x.sum(-1, keepdim=True))(-torch.log(torch.rand(*s, V, generator=g)))
    pt = dirichlet(2, gamma)
    pd_ = torch.stack([0.8 * pt[0] + 0.2 * dirichlet(gamma), dirichlet(gamma)])
    alpha = acceptance_rate(pd_, pt).double()  # [2, gamma]
    reach = torch.cat([torch.ones(2, 1, dtype=torch.float64), alpha.cumprod(1)[:, :-1]], 1)
    truth = ((reach * alpha).mean(0) / reach.mean(0)).numpy()
    naive = alpha.mean(0).numpy()

    kind = torch.randint(0, 2, (n_rounds,), generator=g)
    p_d = pd_[kind]
    tokens = sample(p_d, g)
    logits = torch.cat([pt[kind], pt[kind][:, :1]], 1).log()
    res = verify_chain(logits, p_d, tokens, generator=g)
    acc = res.accepted.numpy()
    df = pd.DataFrame({"sample_id": np.arange(n_rounds) // per_sample, "round": np.arange(n_rounds) % per_sample,
                       "proposal_len": gamma, "accepted": acc, "emitted": acc + 1})
    for k in range(gamma):
        df[f"accept_prob_{k + 1}"] = res.accept_prob[:, k].numpy()
        df[f"alpha_{k + 1}"] = res.alpha[:, k].numpy()
    return df, truth, naive


def test_rao_blackwell_estimate_is_unbiased_and_tighter():
    df, truth, naive = _verified_rounds(20_000)
    assert np.abs(naive - truth)[1:].min() > 0.05  # the test can tell weighting from a plain mean
    t = position_table(df, gamma=4, n_boot=300)
    for col, lo, hi in (("acceptance", "ci_low", "ci_high"), ("acceptance_rb", "rb_ci_low", "rb_ci_high")):
        half = (t[hi] - t[lo]).to_numpy() / 2
        assert np.all(np.abs(t[col].to_numpy() - truth) < 2.5 * half + 1e-3), (col, t[col].to_numpy(), truth)
    # Lower variance: a narrower interval at every position, much narrower at the last.
    w_count, w_rb = (t.ci_high - t.ci_low).to_numpy(), (t.rb_ci_high - t.rb_ci_low).to_numpy()
    assert np.all(w_rb < w_count) and w_rb[-1] < 0.7 * w_count[-1]
    # Expected attempts track the real ones.
    assert np.allclose(t.expected_attempts, t.attempts, rtol=0.05)


def test_rao_blackwell_skips_unverified_positions():
    df, _, _ = _verified_rounds(2_000)
    full = position_table(df, gamma=4, n_boot=50)
    cut = df.copy()
    cut.loc[::2, ["accept_prob_4", "alpha_4"]] = np.nan  # half the rounds verified only 3 positions
    part = position_table(cut, gamma=4, n_boot=50)
    assert np.allclose(part.acceptance_rb[:3], full.acceptance_rb[:3])
    assert part.expected_attempts[3] < 0.6 * full.expected_attempts[3]
    no_rb = position_table(df.drop(columns=[c for c in df if c.startswith(("alpha_", "accept_prob_"))]), gamma=4, n_boot=50)
    assert no_rb.acceptance_rb.isna().all() and np.allclose(no_rb.acceptance, full.acceptance)


def test_domain_table_survival_is_the_unconditional_rate():
    """fig2.csv's survival: P(accepted >= k | proposed >= k) per benchmark, averaged over the domain."""
    a = pd.DataFrame({"sample_id": ["x", "x", "y"], "proposal_len": [3, 3, 2], "accepted": [3, 1, 0], "emitted": [4, 2, 1]})
    b = pd.DataFrame({"sample_id": ["z", "z"], "proposal_len": [3, 3], "accepted": [2, 2], "emitted": [3, 3]})
    t = domain_position_table([a, b], 3, n_boot=10)
    want_a = np.array([2 / 3, 1 / 3, 1 / 2])  # accepted >= k / proposed >= k
    want_b = np.array([1.0, 1.0, 0.0])
    np.testing.assert_allclose(t["survival"], (want_a + want_b) / 2)


def _chain_records(p, n_samples, rng, rounds=8, sample_ids=None):
    """Rounds of a K-token chain accepted position by position with probabilities p."""
    rows = []
    for s in (range(n_samples) if sample_ids is None else sample_ids):
        for r in range(rounds):
            a = 0
            while a < len(p) and rng.random() < p[a]:
                a += 1
            rows.append(dict(sample_id=s, round=r, proposal_len=len(p), accepted=a, emitted=a + 1))
    return pd.DataFrame(rows)


def test_paired_contrast_of_identical_records_is_exactly_zero_and_ignores_row_order():
    from deepspec.core.acceptance import contrast, paired_replicates

    df = _chain_records([0.6, 0.4, 0.4], 30, np.random.default_rng(0))
    shuffled = df.sample(frac=1.0, random_state=1)  # another row (and first-appearance) order
    reps = paired_replicates({"a": [df], "b": [shuffled]}, "count", 3, n_boot=300, seed=0)
    for k in range(3):
        assert contrast((reps["a"][0][k], reps["a"][1][:, k]), (reps["b"][0][k], reps["b"][1][:, k])) == (0.0, 0.0, 0.0)


def test_paired_contrast_finds_a_real_difference_and_covers_a_null_one():
    """95 % intervals of a method difference: a 0.25 gap at position 2 excluded
    from 0 every time; with equal rates, 0 inside the interval in >= 80 % of
    40 independent repetitions (nominal 95 %)."""
    from deepspec.core.acceptance import contrast, paired_replicates

    # (a percentile bootstrap of a ratio over 25-40 prompts covers ~91 % at
    # positions 2-3 in a 150-repetition simulation, hence the 80 % floor)
    rng, covered = np.random.default_rng(3), 0
    for rep in range(40):
        same = paired_replicates({"x": [_chain_records([0.5, 0.4, 0.4], 40, rng)],
                                  "y": [_chain_records([0.5, 0.4, 0.4], 40, rng)]}, "count", 3, n_boot=300, seed=rep)
        _, lo, hi = contrast((same["x"][0][1], same["x"][1][:, 1]), (same["y"][0][1], same["y"][1][:, 1]))
        covered += lo <= 0 <= hi
        if rep < 5:
            gap = paired_replicates({"x": [_chain_records([0.5, 0.65, 0.4], 25, rng)],
                                     "y": [_chain_records([0.5, 0.4, 0.4], 25, rng)]}, "count", 3, n_boot=300, seed=rep)
            assert contrast((gap["x"][0][1], gap["x"][1][:, 1]), (gap["y"][0][1], gap["y"][1][:, 1]))[1] > 0
    assert covered >= 32, covered


def test_paired_replicates_average_benchmarks_and_count_missing_prompts_as_zero():
    from deepspec.core.acceptance import paired_replicates, summarize_rounds

    rng = np.random.default_rng(5)
    b1, b2 = _chain_records([0.9, 0.9], 10, rng), _chain_records([0.1, 0.1], 10, rng)
    partial = _chain_records([0.9, 0.9], 10, rng, sample_ids=range(5))  # prompts 5..9 without rounds
    out = paired_replicates({"m": [b1, b2], "n": [partial, b2]}, "tau", 2, n_boot=200, seed=0)
    assert out["m"][0][0] == pytest.approx((summarize_rounds(b1)["tau"] + summarize_rounds(b2)["tau"]) / 2)
    assert out["m"][1].shape == (200, 1) and np.isfinite(out["n"][1]).all()
    with pytest.raises(ValueError, match="same benchmarks"):
        paired_replicates({"m": [b1, b2], "n": [b2]}, "tau", 2)

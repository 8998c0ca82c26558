"""Statistical tests of verification (deepspec/core/verify.py) and of the
position statistics and loss weights built on it.

Each losslessness test fixes a per-position target distribution p_t^k and a
draft distribution p_d^k (context-independent, which is a valid model), draws
>= 200k draft chains from p_d, verifies them, and checks with a chi-square test
that the first emitted token, and the first two emitted tokens jointly, follow
the target exactly. Rounds that emit only one token continue with a second
verification round starting at the next position, as the decode loop would.
"""
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from deepspec.core.acceptance import per_position_acceptance
from deepspec.core.losses import position_weights
from deepspec.core.verify import acceptance_rate, expected_tau, sample, verify_chain

N = 200_000
V = 6


def _dists(kind: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n positions of (p_t, p_d) pairs of a given shape."""
    def dirichlet():  # Dirichlet(1, ..., 1) from normalised exponentials
        x = -torch.log(torch.rand(n, V, generator=gen).clamp_min(1e-12))
        return x / x.sum(-1, keepdim=True)

    if kind == "dirichlet":
        return dirichlet(), dirichlet()
    if kind == "peaked":
        pt = torch.full((n, V), 0.02)
        pt[:, 0] = 1 - 0.02 * (V - 1)
        pd = torch.full((n, V), 0.03)
        pd[:, 1] = 1 - 0.03 * (V - 1)
        return pt, pd
    if kind == "disjoint":
        pt = torch.zeros(n, V)
        pt[:, : V // 2] = dirichlet()[:, : V // 2]
        pd = torch.zeros(n, V)
        pd[:, V // 2 :] = dirichlet()[:, V // 2 :]
        return pt / pt.sum(-1, keepdim=True), pd / pd.sum(-1, keepdim=True)
    if kind == "draft_zero":  # p_d is zero where p_t is not
        pt = dirichlet()
        pd = dirichlet()
        pd[:, :2] = 0
        return pt, pd / pd.sum(-1, keepdim=True)
    if kind == "near_onehot":
        pt = torch.full((n, V), 1e-4)
        pt[:, 2] = 1.0
        pd = torch.full((n, V), 1e-4)
        pd[:, 2] = 0.6
        pd[:, 3] = 0.4
        return pt / pt.sum(-1, keepdim=True), pd / pd.sum(-1, keepdim=True)
    raise ValueError(kind)


def _tempered(pt: torch.Tensor, T: float) -> torch.Tensor:
    return torch.softmax(torch.log(pt) / T, dim=-1)


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; cells of zero probability must be empty, cells with
    expected count < 5 are pooled."""
    counts = counts.ravel().astype(float)
    probs = probs.ravel().astype(np.float64)
    probs = probs / probs.sum()
    assert counts[probs == 0].sum() == 0, "a token of zero target probability was emitted"
    exp = probs * counts.sum()
    exp = exp * (counts.sum() / exp.sum())
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    return stats.chisquare(obs_c[keep], exp_c[keep]).pvalue


def _run_rounds(pt_pos, pd_pos, gamma, T, gen, start=0, n=N):
    """One verification round for n rows starting at position `start`."""
    logits = torch.log(pt_pos[start : start + gamma + 1]).clamp_min(-1e4)  # [g+1, V]
    pd = pd_pos[start : start + gamma]  # [g, V] already the tempered draft
    draft = sample(pd.expand(n, gamma, V).contiguous(), gen)  # [n, g]
    res = verify_chain(
        logits.expand(n, gamma + 1, V), pd.expand(n, gamma, V), draft, temperature=T, generator=gen
    )
    return draft, res


CASES = list(itertools.product(["dirichlet", "peaked", "disjoint", "draft_zero", "near_onehot"], [1, 3, 7], [1.0, 0.7]))


def _case(kind, gamma, T, seed):
    """p-values of the first token and of the first two tokens, and the
    position-1 acceptance frequency with its Eq. 8 value."""
    gen = torch.Generator().manual_seed(seed)
    pt_raw, pd = _dists(kind, gamma + 2, gen)
    pt = _tempered(pt_raw, T)  # = softmax(logits / T) with logits = log pt_raw
    draft, res = _run_rounds(pt_raw, pd, gamma, T, gen)  # drafts come from pd as given

    first = res.tokens[:, 0].numpy()
    p1 = _chi2_ok(np.bincount(first, minlength=V), pt[0].numpy())
    # Second emitted token: from this round, or from a new round at position 2.
    second = res.tokens[:, 1].clone()
    need = res.num_emitted < 2
    if need.any():
        _, res2 = _run_rounds(pt_raw, pd, gamma, T, gen, start=1, n=int(need.sum()))
        second[need] = res2.tokens[:, 0]
    joint = np.zeros((V, V))
    np.add.at(joint, (first, second.numpy()), 1)
    p2 = _chi2_ok(joint, np.outer(pt[0].numpy(), pt[1].numpy()))
    rate = float(acceptance_rate(pd[0], pt[0]))
    freq = float((res.accepted >= 1).float().mean())
    return p1, p2, freq, rate


@pytest.mark.parametrize("kind,gamma,T", CASES)
def test_lossless_first_two_tokens(kind, gamma, T):
    p1, p2, freq, rate = _case(kind, gamma, T, seed=CASES.index((kind, gamma, T)) * 7919 + 17)
    assert p1 > 1e-3, f"first token off the target distribution (p={p1:.2e})"
    assert p2 > 1e-3, f"first two tokens off the target distribution (p={p2:.2e})"
    se = max(np.sqrt(rate * (1 - rate) / N), 1e-6)
    assert abs(freq - rate) < 5 * se + 1e-9, (freq, rate)


def test_greedy_exact():
    gen = torch.Generator().manual_seed(0)
    B, g, Vv = 64, 5, 11
    logits = torch.randn(B, g + 1, Vv, generator=gen)
    argmax = logits.argmax(-1)
    n_ok = torch.randint(0, g + 1, (B,), generator=gen)
    draft = argmax[:, :g].clone()
    for b in range(B):
        if n_ok[b] < g:
            draft[b, n_ok[b]] = (argmax[b, n_ok[b]] + 1) % Vv
    probs = torch.nn.functional.one_hot(draft, Vv).float()
    res = verify_chain(logits, probs, draft, temperature=0.0)
    assert torch.equal(res.accepted, n_ok)
    assert torch.equal(res.num_emitted, n_ok + 1)
    for b in range(B):
        a = int(n_ok[b])
        assert torch.equal(res.tokens[b, : a + 1], argmax[b, : a + 1])
        assert (res.tokens[b, a + 1 :] == -1).all()
    assert torch.equal(res.accept_prob, (draft == argmax[:, :g]).float()) and torch.equal(res.alpha, res.accept_prob)


def test_acceptance_probabilities_of_a_verification():
    """accept_prob_k = min(1, p_t(x_k)/p_d(x_k)); alpha_k = sum min(p_d, p_t), its
    mean over x_k ~ p_d; and token k is accepted (given 1..k-1) at rate accept_prob_k."""
    gen = torch.Generator().manual_seed(0)
    B, g, Vv = 200_000, 3, 5
    pt = torch.softmax(torch.randn(1, g + 1, Vv, generator=gen), -1)
    pd_ = torch.softmax(torch.randn(1, g, Vv, generator=gen), -1)
    draft = sample(pd_.expand(B, g, Vv), gen)
    res = verify_chain(pt.log().expand(B, -1, -1), pd_.expand(B, -1, -1), draft, generator=gen)
    ratio = (pt[0, :g].gather(-1, draft.T).T / pd_[0].gather(-1, draft.T).T).clamp(max=1)
    assert torch.allclose(res.accept_prob, ratio)
    assert torch.allclose(res.alpha, acceptance_rate(pd_, pt[:, :g]).expand(B, g))
    assert torch.allclose(res.accept_prob.mean(0), res.alpha[0], atol=5 / np.sqrt(B))
    for k in range(g):  # empirical acceptance at k among rounds that reached it
        reached = res.accepted >= k
        got = (res.accepted[reached] > k).float().mean()
        assert abs(got - res.accept_prob[reached, k].mean()) < 5 / np.sqrt(int(reached.sum()))


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_accepted_eos_ends_round_without_bonus(T):
    g, Vv, eos = 4, 5, 3
    # The target is certain of 1, 3(EOS), 2, 2, 2: the draft proposes exactly that.
    tgt = torch.tensor([1, eos, 2, 2, 2])
    logits = torch.full((1, g + 1, Vv), -30.0)
    logits[0, torch.arange(g + 1), tgt] = 30.0
    draft = tgt[:g].unsqueeze(0)
    probs = torch.nn.functional.one_hot(draft, Vv).float()
    res = verify_chain(logits, probs, draft, temperature=T, eos_token_ids=[eos], generator=torch.Generator().manual_seed(0))
    assert res.accepted.tolist() == [2]
    assert res.num_emitted.tolist() == [2]
    assert res.tokens[0].tolist() == [1, eos, -1, -1, -1]
    # A rejected EOS does not end the round: the correction is emitted.
    draft2 = torch.tensor([[1, 4, eos, 2]])
    res2 = verify_chain(logits, torch.nn.functional.one_hot(draft2, Vv).float(), draft2, temperature=T,
                        eos_token_ids=[eos], generator=torch.Generator().manual_seed(0))
    assert res2.accepted.tolist() == [1]
    assert res2.tokens[0].tolist() == [1, eos, -1, -1, -1]
    assert res2.num_emitted.tolist() == [2]


def test_acceptance_rate_is_one_minus_half_l1():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(10, 7, generator=gen), -1)
    q = torch.softmax(torch.randn(10, 7, generator=gen), -1)
    torch.testing.assert_close(acceptance_rate(p, q), 1 - 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(acceptance_rate(p, p), torch.ones(10))


def test_expected_tau_matches_simulation():
    rng = np.random.default_rng(0)
    c = np.array([0.9, 0.8, 0.85, 0.7, 0.95, 0.6, 0.75])
    n = 200_000
    acc = rng.random((n, 7)) < c
    accepted = np.cumprod(acc, 1).sum(1)
    sim_tau = (accepted + 1).mean()
    assert abs(float(expected_tau(torch.tensor(c))) - sim_tau) < 0.02
    # Brute force over all 2^7 accept patterns.
    brute = 0.0
    for pattern in itertools.product([0, 1], repeat=7):
        p = np.prod([c[i] if pattern[i] else 1 - c[i] for i in range(7)])
        brute += p * (1 + np.cumprod(pattern).sum())
    assert abs(float(expected_tau(torch.tensor(c, dtype=torch.float64))) - brute) < 1e-9


def test_position_weights_use_decay_four():
    w = position_weights(7)
    np.testing.assert_allclose(w.numpy(), [1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231], atol=1e-4)


def test_per_position_acceptance_hand_made():
    # Rounds: (proposal_len, accepted)
    L = [3, 3, 3, 2, 3]
    A = [0, 1, 3, 2, 2]
    s = per_position_acceptance(L, A)
    assert s.position.tolist() == [1, 2, 3]
    assert s.attempts.tolist() == [5, 4, 2]  # k=3: rounds with L>=3 and A>=2: #3, #5
    assert s.accepted.tolist() == [4, 3, 1]
    np.testing.assert_allclose(s.conditional, [4 / 5, 3 / 4, 1 / 2])
    assert s.proposed.tolist() == [5, 5, 4]
    np.testing.assert_allclose(s.survival, [4 / 5, 3 / 5, 1 / 4])
    with pytest.raises(ValueError):
        per_position_acceptance([2], [3])


def test_sample_follows_probs_and_never_draws_zero_mass():
    """Inverse-CDF `sample`: chi-squared against the distribution (unnormalised,
    with zero-mass entries at both ends and inside), zero-mass indices never drawn,
    and the one-hot (greedy) case returns the argmax."""
    p = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0])
    n = 40_000
    draws = sample(p.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    pos = p > 0
    expected = p[pos].double() / p.sum().double() * n
    assert stats.chisquare(counts[pos].numpy(), expected.numpy()).pvalue > 1e-3
    onehot = torch.nn.functional.one_hot(torch.tensor([5, 0, 7]), 8).float()
    assert sample(onehot, torch.Generator().manual_seed(1)).tolist() == [5, 0, 7]


def test_sample_with_one_generator_per_row_matches_rows_alone():
    """A list of generators gives each row of probs [B, k, V] its own stream: the
    draws equal what each row draws alone with its generator (the batched engine's
    batch independence rests on it)."""
    probs = torch.softmax(torch.randn(4, 3, 50, generator=torch.Generator().manual_seed(2)), -1)
    together = sample(probs, [torch.Generator().manual_seed(10 + b) for b in range(4)])
    alone = torch.cat([sample(probs[b : b + 1], torch.Generator().manual_seed(10 + b)) for b in range(4)])
    assert torch.equal(together, alone)
    assert not torch.equal(together, sample(probs, torch.Generator().manual_seed(10)))

"""End-to-end tests of the speculative decode loop (deepspec/core/decode.py) on the tiny target.

Losslessness: sequences sampled with a drafter follow the target's distribution.
The first `N_TOK` generated tokens are compared with their exact target
probabilities by a chi-square test over the likely sequences (cells with an
expected count >= 5, the rest pooled). The test double drafts from a distorted
copy of the target, so drafts are often but not always accepted and a wrong
residual is visible; the negative control shows the test rejects such a verifier.
Greedy decoding must reproduce plain greedy decoding token for token.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from deepspec.core import decode
from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.verify import sample, verify_chain
from deepspec.errors import DeepSpecError

from helpers import PROMPT, DistortedTargetDrafter, chi2_pvalue

N_TOK = 3  # compared tokens: the first comes from prefill, 2 and 3 from one round with 2 drafts
N_GEN = 400
P_MIN = 1e-3


@dataclass
class Proposal:
    tokens: torch.Tensor
    probs: torch.Tensor
    conf_logits: Optional[torch.Tensor] = None




def _generate(target, drafter, n, temperature=1.0, max_new=N_TOK + 1, **kw):
    return [
        tuple(speculative_generate(target, drafter, PROMPT, feature_layers=[-1, 0], max_new_tokens=max_new,
                                   temperature=temperature, generator=torch.Generator().manual_seed(980406 + i),
                                   **kw).tokens)
        for i in range(n)
    ]


@torch.no_grad()
def _exact_cells(target, n_tok, k=12):
    """Exact target probabilities of the likely n_tok-token continuations of PROMPT
    (a top-k tree at T = 1, EOS not expanded): {sequence: probability}."""
    eos = set(target.eos_token_ids)
    cells = {(): 1.0}
    for _ in range(n_tok):
        seqs = [s for s in cells if not (set(s) & eos)]
        ids = torch.tensor([PROMPT + list(s) for s in seqs])
        p = torch.softmax(target.model(ids, logits_to_keep=1).logits[:, -1].double(), -1)
        top = p.topk(k, dim=-1)
        cells = {s + (int(t),): cells[s] * float(q) for s, v, i in zip(seqs, top.values, top.indices)
                 for q, t in zip(v, i)}
    return cells




def _broken_verify_chain(target_logits, draft_probs, draft_tokens, *, temperature=1.0, eos_token_ids=(), generator=None):
    """A classic bug: on rejection, resample from p_t instead of norm(max(0, p_t - p_d))."""
    res = verify_chain(target_logits, draft_probs, draft_tokens, temperature=temperature,
                                 eos_token_ids=eos_token_ids, generator=generator)
    a = int(res.accepted[0])
    if a < draft_tokens.shape[1]:
        p_t = torch.softmax(target_logits[0, a].float() / temperature, -1)
        res.tokens[0, a] = int(sample(p_t, generator))
    return res


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny-model forwards are dominated by thread sync: one thread is 5-25x faster
    on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def double(tiny_target):
    return DistortedTargetDrafter(tiny_target, [-1, 0], gamma=2)


@pytest.fixture(scope="module")
def exact(tiny_target):
    return {n: _exact_cells(tiny_target, n) for n in (2, N_TOK)}


def _pvalues(samples, exact):
    """Chi-square p-values of the first 2 and the first N_TOK tokens."""
    return [chi2_pvalue([s[:n] for s in samples], exact[n]) for n in (2, N_TOK)]


def test_lossless_with_test_double(tiny_target, exact, double):
    samples = _generate(tiny_target, double, N_GEN)
    assert min(_pvalues(samples, exact)) > P_MIN / 2


def test_lossless_in_bf16(tiny_cfg):
    """The same test with the target in bf16 (decoding's KV-cached forwards against
    the exact probabilities of the bf16 target's full forwards)."""
    from deepspec.targets.loading import target_from_config

    t16 = target_from_config(tiny_cfg, dtype="bfloat16")
    assert next(t16.model.parameters()).dtype == torch.bfloat16
    exact = {n: _exact_cells(t16, n) for n in (2, N_TOK)}
    samples = _generate(t16, DistortedTargetDrafter(t16, [-1, 0], gamma=2), N_GEN)
    assert min(_pvalues(samples, exact)) > P_MIN / 2


def test_broken_verifier_is_detected(tiny_target, exact, double, monkeypatch):
    """Negative control: the same test rejects a verifier with a wrong residual."""
    monkeypatch.setattr(decode, "verify_chain", _broken_verify_chain)
    samples = _generate(tiny_target, double, N_GEN)
    assert _pvalues(samples, exact)[0] < P_MIN


def test_greedy_equals_plain_and_feature_bookkeeping(tiny_target):
    drafter = DistortedTargetDrafter(tiny_target, [-1, 0], gamma=3, check_feats=True)
    drafter.SHARP = 1.0  # a closer drafter: long accepted runs as well as rejections
    for max_new in (1, 2, 9, 24):
        plain = plain_generate(tiny_target, PROMPT, max_new_tokens=max_new, temperature=0.0).tokens
        gen = speculative_generate(tiny_target, drafter, PROMPT, feature_layers=[-1, 0], max_new_tokens=max_new,
                                   temperature=0.0)
        assert gen.tokens == plain and len(gen.tokens) == max_new
        # Full proposals are verified to the end; only the last round may overshoot and be trimmed.
        emitted = [r["emitted"] for r in gen.rounds]
        assert sum(emitted) + 1 >= len(gen.tokens) and sum(emitted[:-1]) + 1 < len(gen.tokens) + (not emitted)
        if max_new == 24:
            assert {r["accepted"] for r in gen.rounds} >= {0, 3}, gen.rounds  # both paths exercised
        for r in gen.rounds:  # greedy: accept_prob_k = 1{draft k = target argmax}
            a = [r[f"accept_prob_{k}"] for k in (1, 2, 3)]
            assert a[: r["accepted"]] == [1.0] * r["accepted"] and (r["accepted"] == 3 or a[r["accepted"]] == 0.0)


def test_round_records_and_threshold(tiny_target):
    drafter = DistortedTargetDrafter(tiny_target, [-1, 0], gamma=3, conf=True)
    gen = speculative_generate(tiny_target, drafter, PROMPT, feature_layers=[-1, 0], max_new_tokens=12,
                               generator=torch.Generator().manual_seed(1))
    assert len(gen.tokens) == 12
    for r in gen.rounds:
        assert 0 <= r["accepted"] <= r["proposal_len"] <= 3 and r["emitted"] == r["accepted"] + 1
        assert r["draft_time_s"] > 0 and r["verify_time_s"] > 0
        assert r["conf_logit_1"] == pytest.approx(2.0) and r["conf_logit_3"] == pytest.approx(-2.0)
        a = [r[f"accept_prob_{k}"] for k in (1, 2, 3)]
        alpha = [r[f"alpha_{k}"] for k in (1, 2, 3)]
        assert all(0 <= x <= 1 for x in a + alpha)
        assert all(x > 0 for x in a[: r["accepted"]])  # a token with min(1, p_t/p_d) = 0 is never accepted
    # sigmoid(conf) = 0.88, 0.5, 0.12: threshold 0.6 keeps one token per round
    gen = speculative_generate(tiny_target, drafter, PROMPT, feature_layers=[-1, 0], max_new_tokens=12,
                               generator=torch.Generator().manual_seed(1), confidence_threshold=0.6)
    assert all(r["proposal_len"] == 1 for r in gen.rounds[:-1])
    for r in gen.rounds:  # only the verified position carries acceptance probabilities
        assert 0 <= r["accept_prob_1"] <= 1 and math.isnan(r["accept_prob_2"]) and math.isnan(r["alpha_3"])


def test_accepted_eos_ends_round(tiny_target):
    """A drafter equal to the target (p_d = p_t) has every draft accepted. Declaring the
    second draft token of round 1 to be EOS must end that round there, without a bonus,
    with proposal_len = EOS position, and stop generation."""
    drafter = DistortedTargetDrafter(tiny_target, [-1, 0], gamma=3)
    drafter.SHARP = 1.0
    drafter.bias.zero_()
    run = lambda t: speculative_generate(t, drafter, PROMPT, feature_layers=[-1, 0], max_new_tokens=30,
                                         generator=torch.Generator().manual_seed(3))
    first = run(tiny_target)
    assert first.rounds[0]["accepted"] == 3 and first.rounds[0]["emitted"] == 4
    eos = first.tokens[2]  # t1 from prefill, then drafts 1 and 2 of round 1
    assert eos not in first.tokens[:2]
    gen = run(dataclasses.replace(tiny_target, eos_token_ids=(eos,)))
    assert gen.tokens == first.tokens[:3] and len(gen.rounds) == 1
    r = gen.rounds[0]
    assert (r["proposal_len"], r["accepted"], r["emitted"]) == (2, 2, 2)


def test_mismatched_drafter_is_a_clear_error(tiny_target):
    class WrongVocab(DistortedTargetDrafter):
        def propose(self, state, feats, tokens, *, temperature=1.0, generator=None):
            prop = super().propose(state, feats, tokens, temperature=temperature, generator=generator)
            return Proposal(prop.tokens, prop.probs[..., :1000])

    with pytest.raises(DeepSpecError, match="mismatch"):
        speculative_generate(tiny_target, WrongVocab(tiny_target, [-1, 0]), PROMPT, feature_layers=[-1, 0],
                             max_new_tokens=4)


# --------------------------------------------------------------------------- real drafters
N_GEN_REAL = 120  # ~0.1 s per generation with an untrained 7-token drafter


@pytest.fixture(scope="module", params=["eagle3", "dflash", "dspark"])
def real_drafter(request, tiny_target, tiny_cfg):
    from deepspec import drafters

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return drafters.build_drafter(request.param, tiny_target, tiny_cfg).eval()


def test_lossless_with_real_drafters_t1(tiny_target, tiny_cfg, real_drafter, exact):
    """T = 1.0 (Table 1 setting): untrained drafters are mostly rejected, so this checks
    that the drafters' state handling and the loop keep the target distribution."""
    layers = tiny_cfg["target"]["feature_layers"]
    samples = [
        tuple(speculative_generate(tiny_target, real_drafter, PROMPT, feature_layers=layers, max_new_tokens=3,
                                   temperature=1.0, generator=torch.Generator().manual_seed(980406 + i)).tokens[:2])
        for i in range(N_GEN_REAL)
    ]
    assert chi2_pvalue(samples, exact[2], min_cells=2) > P_MIN


def test_greedy_real_drafters_equal_plain(tiny_target, tiny_cfg, real_drafter):
    plain = plain_generate(tiny_target, PROMPT, max_new_tokens=20, temperature=0.0).tokens
    gen = speculative_generate(tiny_target, real_drafter, PROMPT, feature_layers=tiny_cfg["target"]["feature_layers"],
                               max_new_tokens=20, temperature=0.0)
    assert gen.tokens == plain
    assert gen.rounds and max(r["proposal_len"] for r in gen.rounds) == 7  # block 7 / TTT 7 proposals


def test_algorithm1_in_the_batch1_loop_is_lossless(tiny_target, tiny_cfg, exact):
    """eval.speed_alg1: Algorithm 1 picks each round's verified length from the
    DSpark drafter's confidences and an SPS curve (here one where a verified token
    costs 30 % of a step, so it verifies short, varying prefixes); the output keeps
    the target's distribution at T = 1 and equals plain decoding when greedy."""
    import numpy as np

    from deepspec import drafters
    from deepspec.core.policies import LiveAlgorithm1
    from deepspec.core.scheduler import SPSCurve

    with torch.random.fork_rng():
        torch.manual_seed(0)
        d = drafters.build_drafter("dspark", tiny_target, tiny_cfg).eval()
    B = np.arange(1, 9)
    pol = LiveAlgorithm1(SPSCurve(B, 1.0 / (1.0 + 0.3 * (B - 1))))
    layers = tiny_cfg["target"]["feature_layers"]
    samples = [tuple(speculative_generate(tiny_target, d, PROMPT, feature_layers=layers, max_new_tokens=3,
                                          temperature=1.0, generator=torch.Generator().manual_seed(980406 + i),
                                          policy=pol).tokens[:2]) for i in range(N_GEN_REAL)]
    assert chi2_pvalue(samples, exact[2], min_cells=2) > P_MIN
    plain = plain_generate(tiny_target, PROMPT, max_new_tokens=20, temperature=0.0).tokens
    gen = speculative_generate(tiny_target, d, PROMPT, feature_layers=layers, max_new_tokens=20, temperature=0.0,
                               policy=pol)
    assert gen.tokens == plain
    lengths = {r["proposal_len"] for r in gen.rounds}
    assert max(lengths) < 7 and len(lengths) >= 1  # short prefixes, not the full block


def test_algorithm1_ends_the_dspark_block_where_no_verification_reaches(tiny_target, tiny_cfg, monkeypatch):
    """`LiveAlgorithm1.stop_after`: the first position at which it fires is one past
    the length Algorithm 1 picks from the whole block, so a block drafted only that
    far is verified exactly as the whole one would be; the Markov loop stops there."""
    import numpy as np

    from deepspec import drafters
    from deepspec.core.decode import Proposal
    from deepspec.core.policies import LiveAlgorithm1
    from deepspec.core.scheduler import SPSCurve

    B = np.arange(1, 9)
    pol = LiveAlgorithm1(SPSCurve(B, 1.0 / (1.0 + 0.1 * (B - 1))))
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        c = torch.randn(1, 7, generator=g) * 3
        full = pol.lengths([Proposal(tokens=torch.zeros(1, 7, dtype=torch.long), probs=None, conf_logits=c)])[0]
        first = next((k for k in range(1, 8) if pol.stop_after(c[:, :k])), None)
        assert (first is None and full == 7) or first == full + 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        d = drafters.build_drafter("dspark", tiny_target, tiny_cfg).eval()
    drafted, real = [], d.propose
    monkeypatch.setattr(d, "propose", lambda *a, **kw: drafted.append(real(*a, **kw)) or drafted[-1])
    gen = speculative_generate(tiny_target, d, PROMPT, feature_layers=tiny_cfg["target"]["feature_layers"],
                               max_new_tokens=20, temperature=0.0, policy=pol)
    assert gen.tokens == plain_generate(tiny_target, PROMPT, max_new_tokens=20, temperature=0.0).tokens
    for prop, r in zip(drafted, gen.rounds):
        n = prop.tokens.shape[1]
        assert r["proposal_len"] == n - 1 or (n == 7 and r["proposal_len"] >= 6)
    assert min(p.tokens.shape[1] for p in drafted) < 7  # some blocks ended early


def test_profile_target_sps_times_a_batch1_round(tiny_target, tiny_cfg, monkeypatch):
    """SPS(B) for Algorithm 1 at batch size 1: each size timed as the loop's
    verification forward (target_forward with the features), the median of the
    repeats after a warm-up pass, visited in alternating order."""
    seen = []
    real = decode.target_forward
    monkeypatch.setattr(decode, "target_forward", lambda t, ids, c, layers, **kw: seen.append(
        (ids.shape[1], layers)) or real(t, ids, c, layers, **kw))
    sps = decode.profile_target_sps(tiny_target, [1, 2, 4], context_len=8, feature_layers=[1], repeats=3)
    assert list(sps.batch_tokens) == [1, 2, 4] and (sps.steps_per_s > 0).all()
    assert seen[0] == (8, None)  # the context prefill
    assert [b for b, _ in seen[1:]] == [4, 2, 1] + [1, 2, 4, 4, 2, 1, 1, 2, 4]
    assert all(layers == [1] for _, layers in seen[1:])


def test_lm_head_in_chunks_same_logits(tiny_target, monkeypatch):
    """The chunked LM head of multi-row forwards (core/target.py) gives the same logits
    bit for bit, in slices (counted), and leaves one-row forwards to the plain head."""
    from deepspec.core import target as target_mod
    from deepspec.core.batch_cache import engine_cache

    V = tiny_target.vocab_size
    monkeypatch.setattr(tiny_target, "packed_matmuls", False)  # target.cpu_matmul: torch
    monkeypatch.setattr(target_mod, "LM_HEAD_CHUNK", 96)  # several slices and a ragged last one
    ids = torch.tensor([PROMPT[:6]])
    calls = []  # rows of each matmul with (a slice of) the head's weight
    real, head_mem = torch.nn.functional.linear, tiny_target.lm_head.weight.untyped_storage().data_ptr()
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: (
        w.untyped_storage().data_ptr() == head_mem and calls.append(w.shape[0])) or real(x, w, b))
    with torch.no_grad():
        ref = tiny_target.model(input_ids=ids).logits
        calls.clear()
        with target_mod.lm_head_in_chunks(tiny_target, chunk=96):
            got = tiny_target.model(input_ids=ids).logits
            assert len(calls) == math.ceil(V / 96) and sum(calls) == V and max(calls) == 96
            calls.clear()
            one, _ = decode.target_forward(tiny_target, ids[:, :1], engine_cache(), None)
            assert calls == [V]  # one row: the whole head in one matmul
        assert "forward" not in vars(tiny_target.lm_head)  # restored
    assert torch.equal(ref, got)
    assert torch.equal(one, tiny_target.model(input_ids=ids[:, :1]).logits)


def test_prepacked_linears_give_the_targets_logits(tiny_target, monkeypatch):
    """The oneDNN-prepacked linear layers of CPU decoding (core/target.py) give the
    target's logits up to rounding, through every linear layer (counted), one pack
    per weight, redone when a weight changes; modules are restored; with gradients
    they change nothing."""
    from deepspec.core import target as target_mod

    ids = torch.tensor([PROMPT[:6]])
    linears = [m for m in tiny_target.model.modules() if isinstance(m, torch.nn.Linear)]
    monkeypatch.setattr(tiny_target, "packed_matmuls", False)  # target.cpu_matmul: torch
    with torch.no_grad(), target_mod.prepacked_linears(tiny_target):
        assert not any("forward" in vars(m) for m in linears)
    monkeypatch.setattr(tiny_target, "packed_matmuls", True)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with torch.no_grad():
        ref = tiny_target.model(input_ids=ids).logits
        with target_mod.prepacked_linears(tiny_target):
            assert all("forward" in vars(m) for m in linears)
            got = tiny_target.model(input_ids=ids).logits
            one = tiny_target.model(input_ids=ids[:, :1]).logits
        assert not any("forward" in vars(m) for m in linears)  # restored
        packs = [(m.weight, tiny_target._packed_linears[m.weight][1]) for m in linears]  # one per weight
        with target_mod.prepacked_linears(tiny_target):
            assert all(tiny_target._packed_linears[w][1] is p for w, p in packs)  # not packed again
            torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
            try:
                tiny_target.model(input_ids=ids)
            finally:
                torch.ops.mkldnn._linear_pointwise = real
        assert len(calls) == len(linears)
    assert torch.allclose(ref, got, atol=1e-4, rtol=1e-4)
    assert torch.allclose(one, tiny_target.model(input_ids=ids[:, :1]).logits.detach(), atol=1e-4, rtol=1e-4)
    head = tiny_target.lm_head
    saved = head.weight.detach().clone()
    try:
        with torch.no_grad():
            head.weight.mul_(2.0)
            with target_mod.prepacked_linears(tiny_target):
                doubled = tiny_target.model(input_ids=ids).logits
            assert torch.allclose(doubled, tiny_target.model(input_ids=ids).logits, atol=2e-4, rtol=1e-4)  # repacked
            assert not torch.allclose(doubled, got)
    finally:
        with torch.no_grad():
            head.weight.copy_(saved)
    with target_mod.prepacked_linears(tiny_target):  # gradients on: nothing changes
        assert not any("forward" in vars(m) for m in linears)



def test_prepacked_linears_skip_a_target_with_nothing_to_pack(tiny_target):
    """P6: an fp16 (or GPU) target has no CPU weight oneDNN packs: its linear layers are not
    walked on each entry (twice per verification round), nothing is patched."""
    import copy as _copy

    from deepspec.core import target as target_mod

    t = _copy.copy(tiny_target)
    t.__dict__.pop("_linear_modules", None)
    t.__dict__.pop("_packed_linears", None)
    t.model = _copy.deepcopy(tiny_target.model).to(torch.float16)
    t.packed_matmuls = True
    with torch.no_grad(), target_mod.prepacked_linears(t):
        assert not any("forward" in vars(m) for m in t.model.modules() if isinstance(m, torch.nn.Linear))
    assert "_linear_modules" not in t.__dict__ and "_packed_linears" not in t.__dict__


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU")
def test_prepacked_linears_pack_a_bf16_target(tiny_target):
    """Where oneDNN multiplies bf16, a bf16 target's linear layers are packed too (every
    one, counted) and give its unpacked bf16 logits up to bf16 rounding; an 8-token and a
    1-token forward alike."""
    import copy as _copy

    from deepspec.core import target as target_mod

    t = _copy.copy(tiny_target)
    t.__dict__.pop("_linear_modules", None)
    t.__dict__.pop("_packed_linears", None)
    t.model = _copy.deepcopy(tiny_target.model).to(torch.bfloat16)
    t.packed_matmuls = True
    linears = [m for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
    calls, real = [], torch.ops.mkldnn._linear_pointwise
    for ids in (torch.tensor([PROMPT[:8]]), torch.tensor([PROMPT[:1]])):
        with torch.no_grad():
            ref = t.model(input_ids=ids).logits.float()
            with target_mod.prepacked_linears(t):
                assert all("forward" in vars(m) for m in linears)
                torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
                try:
                    got = t.model(input_ids=ids).logits.float()
                finally:
                    torch.ops.mkldnn._linear_pointwise = real
        assert got.dtype == ref.dtype and torch.isfinite(got).all()
        assert (got - ref).abs().max() <= 0.05 * ref.abs().max(), (got - ref).abs().max()
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert len(calls) == 2 * len(linears) and all(w.dtype == torch.bfloat16 for w in t._packed_linears)


@pytest.mark.parametrize("method,extra", [("eagle3", {"draft_vocab_size": 300}), ("dspark", {})])
def test_the_drafters_matmuls_are_packed_with_the_targets(tiny_target, tiny_cfg, monkeypatch, method, extra):
    """With target.cpu_matmul onednn the drafter's proposals multiply through the same
    packed kernels as the target (its linear layers and its draft head, counted): the
    proposals are the unpacked ones up to rounding, the drafter's modules are restored,
    and greedy speculative decoding still reproduces plain greedy decoding."""
    from deepspec.core import target as target_mod

    from helpers import random_drafter

    d, _ = random_drafter(method, tiny_target, tiny_cfg, **extra)
    layers = d.config.deepspec_feature_layers
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = tiny_target.model(input_ids=ids, output_hidden_states=True)
    feats = target_mod.select_features(out.hidden_states, layers)
    tokens = torch.tensor([PROMPT + [int(out.logits[0, -1].argmax())]])

    def propose():
        return d.propose(d.init_state(), feats, tokens, temperature=1.0, generator=torch.Generator().manual_seed(3))

    ref = propose()
    monkeypatch.setattr(tiny_target, "packed_matmuls", True)
    linears = [m for m in d.modules() if isinstance(m, torch.nn.Linear)]
    calls, real = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1]) or real(*a))
    with torch.no_grad(), target_mod.prepacked_linears(tiny_target, d):
        got = propose()
    assert not any("forward" in vars(m) for m in linears)  # restored
    packed = {id(pack): w for w, (_, pack) in tiny_target._packed_linears.items()}
    used = {id(packed[id(c)]) for c in calls}
    assert {id(m.weight) for m in linears} <= used  # every linear layer of the drafter
    assert id(d._shared.head_w) in used  # and its draft head
    assert torch.allclose(got.probs, ref.probs, atol=1e-4)
    kw = dict(max_new_tokens=24, temperature=0.0)
    plain = plain_generate(tiny_target, PROMPT, **kw).tokens
    assert speculative_generate(tiny_target, d, PROMPT, feature_layers=layers, **kw).tokens == plain


def test_a_drafters_packs_go_with_it(tiny_target, tiny_cfg, monkeypatch):
    """The packs kept on the target for a drafter's weights do not keep them alive."""
    import gc

    from deepspec.core import target as target_mod

    from helpers import random_drafter

    monkeypatch.setattr(tiny_target, "packed_matmuls", True)
    gc.collect()  # the drafters of earlier tests that only the cycle collector frees
    d, _ = random_drafter("eagle3", tiny_target, tiny_cfg, draft_vocab_size=300)
    with torch.no_grad(), target_mod.prepacked_linears(tiny_target, d):
        pass
    n = len(tiny_target._packed_linears)
    k = sum(1 for m in d.modules() if isinstance(m, torch.nn.Linear))
    assert d in tiny_target._linear_modules and all(m.weight in tiny_target._packed_linears for m in d.modules()
                                                     if isinstance(m, torch.nn.Linear))
    del d
    gc.collect()
    assert len(tiny_target._packed_linears) == n - k

"""The batched speculative engine (deepspec/core/engine.py) and its verification
policies (deepspec/core/policies.py), on the tiny target.

* Lossless per row: in batches of 4 requests with different prompt lengths, the
  first 3 tokens of each request (the prefill token and one batched round of 2
  drafts) follow the target's exact distribution (chi-square, as test_decode);
  the same test rejects a verifier with a wrong residual.
* Greedy: batched output equals plain greedy decoding, request by request, for
  every drafter (the distorted-target double, DFlash, DSpark, Eagle3) and every
  policy (fixed gamma, static threshold, live Algorithm 1), with continuous
  batching (more requests than rows, different max_new_tokens).
* Batch independence: a request's greedy output is the same alone and in a
  batch. Sampled outputs with the same per-request seed are also the same under
  fixed gamma (each request draws from its own stream in batch-1 order; only
  floating-point ties in the batched forward could break this), and equal the
  batch-1 loop's; under Algorithm 1 l_r depends on the batch mates, so sampled
  outputs differ while their distribution does not.
* Live vs offline Algorithm 1: the engine verifies exactly the l_r that
  `scheduler.schedule_prefix` picks from the same confidences and SPS curve.
"""
from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch

from deepspec.core import decode, verify
from deepspec.core.batch_cache import BatchKV, row_slots
from deepspec.core.decode import plain_generate, speculative_generate
from deepspec.core.engine import BatchedEngine, Request, profile_engine_sps
from deepspec.core.policies import FixedGamma, LiveAlgorithm1, PaddedAlgorithm1, StaticThreshold
from deepspec.core.scheduler import SPSCurve, schedule_prefix
from deepspec.drafters import build_drafter

from helpers import PROMPT, DistortedTargetDrafter, chi2_pvalue

# Four prompts of different lengths (5, 4, 7, 2 tokens)
PROMPTS = [PROMPT, PROMPT[1:], [591, 2293] + PROMPT, PROMPT[3:]]
LAYERS = [-1, 0]
N_GEN = 300  # samples per row in the chi-square test
P_MIN = 1e-3
# A synthetic SPS(B): a fixed cost per forward plus a cost per token, so Algorithm 1
# verifies some drafts and stops early on others.
SPS = SPSCurve(np.arange(1, 65), 1.0 / (1.0 + 0.08 * np.arange(1, 65)))


pytestmark = pytest.mark.usefixtures("one_thread")  # timing-sensitive decoding: one torch thread


def _requests(n_tok, prompts=PROMPTS, seed=0):
    return [Request(i, p, n_tok, seed=seed + i) for i, p in enumerate(prompts)]


def _by_id(finished):
    return {f.request.request_id: f for f in finished}


@torch.no_grad()
def _exact_cells(target, prompt, n_tok, k=12):
    """Exact probabilities of the likely n_tok-token continuations of `prompt` (top-k tree)."""
    eos = set(target.eos_token_ids)
    cells = {(): 1.0}
    for _ in range(n_tok):
        seqs = [s for s in cells if not (set(s) & eos)]
        ids = torch.tensor([prompt + list(s) for s in seqs])
        p = torch.softmax(target.model(ids, logits_to_keep=1).logits[:, -1].double(), -1)
        top = p.topk(k, dim=-1)
        cells = {s + (int(t),): cells[s] * float(q) for s, v, i in zip(seqs, top.values, top.indices)
                 for q, t in zip(v, i)}
    return cells


def _batched_samples(target, drafter, n_tok=3):
    """N_GEN requests per prompt, interleaved, through one engine of 4 rows."""
    reqs = [Request((i, j), PROMPTS[j], n_tok, seed=980406 + 4 * i + j) for i in range(N_GEN) for j in range(4)]
    eng = BatchedEngine(target, drafter, feature_layers=LAYERS, temperature=1.0, max_batch=4)
    out = [[] for _ in PROMPTS]
    for f in eng.generate(reqs):
        out[f.request.request_id[1]].append(tuple(f.tokens))
    return out, eng


@pytest.fixture(scope="module")
def exact4(tiny_target):
    return [{n: _exact_cells(tiny_target, p, n) for n in (2, 3)} for p in PROMPTS]


def test_lossless_per_row_in_a_batch(tiny_target, exact4):
    samples, eng = _batched_samples(tiny_target, DistortedTargetDrafter(tiny_target, LAYERS, gamma=2))
    assert eng.stats["rounds"] < len(PROMPTS) * N_GEN  # rows really shared forwards
    for rows, exact in zip(samples, exact4):
        pv = [chi2_pvalue([s[:n] for s in rows], exact[n]) for n in (2, 3)]
        assert min(pv) > P_MIN / 2, pv


def _broken_rejection_decisions(target_logits, draft_probs, draft_tokens, temperature, u):
    """The classic bug of test_decode's broken verifier, in the engine's batched verification
    (decode.verify_rows): on rejection, resample from p_t instead of norm(max(0, p_t - p_d))."""
    accepted, _, a_k, alpha = verify.rejection_decisions(target_logits, draft_probs, draft_tokens, temperature, u)
    p_t = torch.softmax(target_logits.float() / temperature, -1)
    return accepted, p_t[torch.arange(len(accepted)), accepted], a_k, alpha


def test_batched_broken_verifier_is_detected(tiny_target, exact4, monkeypatch):
    monkeypatch.setattr(decode, "rejection_decisions", _broken_rejection_decisions)
    samples, _ = _batched_samples(tiny_target, DistortedTargetDrafter(tiny_target, LAYERS, gamma=2))
    pv = [chi2_pvalue([s[:2] for s in rows], exact[2]) for rows, exact in zip(samples, exact4)]
    assert min(pv) < P_MIN, pv


def _double(target, conf=True):
    d = DistortedTargetDrafter(target, LAYERS, gamma=3, check_feats=True, conf=conf)
    d.SHARP = 1.0  # long accepted runs as well as rejections
    return d


@pytest.fixture(scope="module")
def drafters(tiny_target, tiny_cfg):
    torch.manual_seed(0)
    out = {"double": _double(tiny_target)}
    for m in ("dflash", "dspark", "eagle3"):
        out[m] = build_drafter(m, tiny_target, tiny_cfg).eval()
    return out


POLICIES = {
    "fixed": lambda: FixedGamma(),
    "threshold": lambda: StaticThreshold(0.5),
    "alg1": lambda: LiveAlgorithm1(SPS, default_confidence=0.6),
    "alg1-padded": lambda: PaddedAlgorithm1(SPS, default_confidence=0.6),
}


@pytest.fixture(scope="module")
def plain_greedy(tiny_target):
    return {i: plain_generate(tiny_target, p, max_new_tokens=14 - 2 * (i % 3), temperature=0.0).tokens
            for i, p in enumerate(PROMPTS + PROMPTS[:2])}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("method", ["double", "dflash", "dspark", "eagle3"])
def test_batched_greedy_equals_plain(tiny_target, drafters, plain_greedy, method, policy, monkeypatch):
    """Six requests through three rows (continuous batching: three join mid-run,
    each into the row of a request that left)."""
    placed = []
    put_many = BatchKV.put_many
    monkeypatch.setattr(BatchKV, "put_many", lambda kv, p: (placed.extend(p), put_many(kv, p)))
    reqs = [Request(i, p, 14 - 2 * (i % 3)) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    eng = BatchedEngine(tiny_target, drafters[method], feature_layers=LAYERS, temperature=0.0, max_batch=3,
                        policy=POLICIES[policy]())
    got = _by_id(eng.generate(reqs))
    for i, want in plain_greedy.items():
        assert got[i].tokens == want, (method, policy, i)
        assert all(r["emitted"] >= 1 and 1 <= r["batch_size"] <= 3 for r in got[i].rounds)
    assert {r["batch_size"] for f in got.values() for r in f.rounds} >= {3}
    assert len(placed) == 3


def test_plain_batched_decoding(tiny_target, plain_greedy):
    eng = BatchedEngine(tiny_target, None, feature_layers=LAYERS, temperature=0.0, max_batch=4)
    got = _by_id(eng.generate([Request(i, p, 14 - 2 * (i % 3)) for i, p in enumerate(PROMPTS + PROMPTS[:2])]))
    assert {i: f.tokens for i, f in got.items()} == plain_greedy


@pytest.mark.parametrize("method", ["double", "dspark"])
def test_batch_independence(tiny_target, drafters, method):
    """Alone == in a batch (greedy and, with fixed gamma, sampled with the same
    seed); sampled also == the batch-1 loop with that seed."""
    d = drafters[method]
    for temp in (0.0, 1.0):
        batched = _by_id(BatchedEngine(tiny_target, d, feature_layers=LAYERS, temperature=temp, max_batch=4)
                         .generate(_requests(12, seed=5)))
        for req in _requests(12, seed=5):
            alone = BatchedEngine(tiny_target, d, feature_layers=LAYERS, temperature=temp, max_batch=1).generate([req])
            assert alone[0].tokens == batched[req.request_id].tokens, (temp, req.request_id)
            loop = speculative_generate(tiny_target, d, req.prompt_ids, feature_layers=LAYERS, max_new_tokens=12,
                                        temperature=temp, generator=torch.Generator().manual_seed(req.seed))
            assert loop.tokens == alone[0].tokens


def test_propose_batch_equals_propose_per_request(tiny_target, tiny_cfg, drafters):
    """Ragged contexts: one batched drafter call drafts what each request's own call drafts."""
    g = torch.Generator().manual_seed(3)
    for m in ("dflash", "dspark", "eagle3"):
        d = drafters[m]
        states, feats, toks = [], [], []
        for n in (5, 2, 9):
            ids = torch.randint(0, tiny_target.vocab_size, (1, n + 1), generator=g)
            f, _ = tiny_target.features(ids[:, :-1], LAYERS)
            states.append(d.init_state())
            feats.append(f)
            toks.append(ids)
        _batch_equals_alone(d, states, feats, toks)


class _Spy:
    """Wraps a policy; keeps each round's proposals' confidences and its lengths."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def lengths(self, props):
        ell = self.inner.lengths(props)
        self.calls.append((self.inner.confidences(props), list(ell)))
        return ell


def test_live_algorithm1_matches_offline_scheduler(tiny_target, drafters):
    d = drafters["dspark"]
    temps = np.linspace(0.7, 1.6, d.gamma)
    spy = _Spy(LiveAlgorithm1(SPS, temperatures=temps))
    eng = BatchedEngine(tiny_target, d, feature_layers=LAYERS, temperature=1.0, max_batch=4, policy=spy)
    done = eng.generate(_requests(16, seed=11))
    assert spy.calls and any(len(set(ell)) > 1 for _, ell in spy.calls)  # ragged l_r happen
    for c, ell in spy.calls:
        want, _ = schedule_prefix(c, SPS, early_stop=True)
        assert list(want) == ell
    # the live confidences are the recorded conf logits, calibrated by STS
    rec = done[0].rounds[0]
    x = np.array([rec[f"conf_logit_{k}"] for k in range(1, d.gamma + 1)])
    live = LiveAlgorithm1(SPS, temperatures=temps).confidences(
        [decode.Proposal(torch.zeros(1, d.gamma), None, torch.from_numpy(x[None]))])
    np.testing.assert_allclose(live[0], 1 / (1 + np.exp(-x / temps)), rtol=1e-6)
    # what the engine verified: every request's record carries its l_r (verify_tokens = 1 + l_r)
    chosen = Counter(x for _, ell in spy.calls for x in ell)
    assert Counter(r["verify_tokens"] - 1 for f in done for r in f.rounds) == chosen


def test_static_threshold_policy_truncates(tiny_target):
    d = _double(tiny_target)  # conf logits 2, 0, -2: sigmoid .88, .5, .12
    eng = BatchedEngine(tiny_target, d, feature_layers=LAYERS, temperature=0.0, max_batch=4,
                        policy=StaticThreshold(0.6))
    done = eng.generate(_requests(10))
    assert {r["proposal_len"] for f in done for r in f.rounds} <= {0, 1}


def test_batch_kv_compacts_and_keeps_rows(tiny_target):
    """Masked slots are compacted away without changing any row's verified tokens."""
    kv = BatchKV()
    for p in PROMPTS:
        cache = decode.new_cache()
        decode.target_forward(tiny_target, torch.tensor([p]), cache, None)
        kv.add(cache, len(p))
    before = [kv.cache.layers[0].keys[r][:, kv.valid[r]].clone() for r in range(4)]
    kv.compact()
    assert kv.length == max(len(p) for p in PROMPTS) and bool(kv.valid[:, -1].all())
    for r in range(4):
        assert torch.equal(kv.cache.layers[0].keys[r][:, kv.valid[r]], before[r])
    assert kv.remove([0, 2]) == [3, 1]  # the last row moves into the first free one
    assert kv.length == max(len(PROMPTS[1]), len(PROMPTS[3])) and torch.equal(kv.valid.sum(1), torch.tensor([2, 4]))
    for r, old in enumerate([3, 1]):
        assert torch.equal(kv.cache.layers[0].keys[r][:, kv.valid[r]], before[old])


def test_batch_kv_removes_rows_and_grows_left_without_copying_the_batch(tiny_target):
    """With the engine's cache layers, removing rows and a longer joining prompt
    keep the buffers (views, one row copied per move), every row keeps its verified
    keys, and the next forward still equals the rows' own forwards."""
    from deepspec.core.batch_cache import engine_cache

    def prefill(p):
        cache = engine_cache()
        decode.target_forward(tiny_target, torch.tensor([p]), cache, None)
        return cache

    def rows(kv, r):
        return kv.cache.layers[1].keys[r][:, kv.valid[r]]

    prompts = PROMPTS + [PROMPT[2:]]
    kv = BatchKV()
    kv.add_many([(prefill(p), len(p)) for p in prompts])
    ids, start = torch.tensor([[7, 8]] * len(prompts)), kv.length
    kv.forward(tiny_target, ids, torch.full((len(prompts),), 2), None)  # moves the cache into the layers' buffers
    kv.commit(start, torch.full((len(prompts),), 2))
    buf = kv.cache.layers[1]._kbuf.data_ptr()
    want = {r: rows(kv, r).clone() for r in range(len(prompts))}
    order = kv.remove([1, 2])
    assert order == [0, 3, 4] and kv.cache.layers[1]._kbuf.data_ptr() == buf
    assert all(torch.equal(rows(kv, r), want[old]) for r, old in enumerate(order))
    longer = PROMPTS[2] + PROMPTS[0] + PROMPTS[1]
    kv.put_many([(1, prefill(longer), len(longer))])  # grows on the left: one copy into a buffer with room there
    buf = kv.cache.layers[1]._kbuf.data_ptr()
    longest = longer + [5]
    kv.put_many([(2, prefill(longest), len(longest))])  # grows again, in place
    assert kv.cache.layers[1]._kbuf.data_ptr() == buf and kv.length == len(longest)
    assert torch.equal(rows(kv, 0), want[0]) and torch.equal(rows(kv, 1), prefill(longer).layers[1].keys[0])
    assert float(kv.cache.layers[1].keys[0][:, ~kv.valid[0]].abs().sum()) == 0.0  # masked slots zeroed
    seqs = [prompts[0] + [7, 8], longer, longest]
    logits, _ = kv.forward(tiny_target, torch.tensor([[9]] * 3), torch.ones(3, dtype=torch.long), None)
    for r, seq in enumerate(seqs):
        alone = tiny_target.model(torch.tensor([seq + [9]])).logits[0, -1]
        torch.testing.assert_close(logits[r, 0], alone, rtol=1e-4, atol=1e-4)


def test_batch_kv_puts_a_request_in_a_left_row_in_place(tiny_target):
    """A joining request overwrites a left request's row: its verified keys are its
    prompt's, the other rows keep theirs, and a longer prompt grows the cache once."""
    def prefill(p):
        cache = decode.new_cache()
        decode.target_forward(tiny_target, torch.tensor([p]), cache, None)
        return cache

    kv = BatchKV()
    kv.add_many([(prefill(p), len(p)) for p in PROMPTS[:3]])
    rows = lambda r: kv.cache.layers[1].values[r][:, kv.valid[r]]  # noqa: E731
    kept = [rows(r).clone() for r in (0, 2)]
    buf = kv.cache.layers[1].values.data_ptr()
    short = prefill(PROMPTS[3])
    kv.put_many([(1, short, len(PROMPTS[3]))])
    assert kv.cache.layers[1].values.data_ptr() == buf  # in place: no copy of the batch
    assert torch.equal(rows(1), short.layers[1].values[0]) and int(kv.valid[1].sum()) == len(PROMPTS[3])
    assert all(torch.equal(rows(r), k) for r, k in zip((0, 2), kept))
    assert float(kv.cache.layers[1].values[1][:, ~kv.valid[1]].abs().sum()) == 0.0  # masked slots zeroed
    longer = PROMPTS[2] + PROMPTS[0]
    kv.put_many([(0, prefill(longer), len(longer))])
    assert kv.length == len(longer) and torch.equal(rows(0), prefill(longer).layers[1].values[0])
    assert torch.equal(rows(2), kept[1]) and torch.equal(rows(1), short.layers[1].values[0])


def test_profile_engine_sps(tiny_target):
    sps = profile_engine_sps(tiny_target, rows=2, widths=[1, 4], context_len=16)
    assert list(sps.batch_tokens) == [2, 8] and np.all(sps.steps_per_s > 0)


@pytest.mark.parametrize("policy", ["fixed", "alg1"])
def test_batched_greedy_equals_plain_on_gemma4(gemma4_target, policy):
    """A sliding-window target: the engine keeps every row's verified tokens adjacent."""
    from deepspec.core.batch_cache import has_sliding_window

    assert has_sliding_window(gemma4_target)
    d = DistortedTargetDrafter(gemma4_target, [0, 1], gamma=3, conf=True)
    d.SHARP = 1.0
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3] * 7, [40, 41, 42]]
    eng = BatchedEngine(gemma4_target, d, feature_layers=[0, 1], temperature=0.0, max_batch=3,
                        policy=POLICIES[policy]())
    got = _by_id(eng.generate([Request(i, p, 12) for i, p in enumerate(prompts)]))
    for i, p in enumerate(prompts):
        assert got[i].tokens == plain_generate(gemma4_target, p, max_new_tokens=12, temperature=0.0).tokens, i


def test_propose_batch_on_both_targets(target, target_cfg):
    """Batched block drafting on the Llama-style and the Gemma4 tiny targets: each row equals its own call."""
    layers = target_cfg["target"]["feature_layers"]
    g = torch.Generator().manual_seed(4)
    for m in ("dspark", "eagle3"):
        torch.manual_seed(0)
        d = build_drafter(m, target, target_cfg).eval()
        states, feats, toks = [], [], []
        for n in (6, 3):
            ids = torch.randint(0, target.vocab_size, (1, n + 1), generator=g)
            feats.append(target.features(ids[:, :-1], layers)[0])
            states.append(d.init_state())
            toks.append(ids)
        _batch_equals_alone(d, states, feats, toks)


def test_padded_algorithm1_picks_the_best_common_width():
    """Brute force over every l in {0..g}^R with the padded cost R(1 + max l): a common width is optimal."""
    import itertools

    rng = np.random.default_rng(0)
    sps = SPSCurve(np.arange(1, 40), 1.0 / (1.0 + 0.1 * np.arange(1, 40)))
    for _ in range(20):
        logits = torch.from_numpy(rng.normal(1.0, 1.5, (3, 4)))
        props = [decode.Proposal(torch.zeros(1, 4), None, logits[r : r + 1]) for r in range(3)]
        pol = PaddedAlgorithm1(sps)
        a = np.cumprod(pol.confidences(props), 1)

        def theta(ell):
            return (3 + sum(a[r, :l].sum() for r, l in enumerate(ell))) * sps(3 * (1 + max(ell)))

        best = max(theta(e) for e in itertools.product(range(5), repeat=3))
        ell = pol.lengths(props)
        assert len(set(ell)) == 1 and theta(ell) == pytest.approx(best)

def _batch_equals_alone(d, states, feats, toks):
    """propose_batch over the rows equals propose per row: greedy, then sampled with
    one generator per row (each row draws what it draws alone), then greedy again
    on the states both calls advanced."""
    for temp in (0.0, 1.0, 0.0):
        gens = lambda: [torch.Generator().manual_seed(50 + r) for r in range(len(states))]  # noqa: E731
        alone = [d.propose(copy.deepcopy(s), f, t, temperature=temp, generator=gen)
                 for s, f, t, gen in zip(states, feats, toks, gens())]
        both = d.propose_batch(states, feats, toks, temperature=temp, generator=gens())
        _rows_equal(both, alone)
        feats, toks = [f[:, :0] for f in feats], [t[:, -1:] for t in toks]  # next call: nothing new verified


def _rows_equal(both, alone):
    for r, p in enumerate(alone):
        assert torch.equal(both.tokens[r : r + 1], p.tokens)
        torch.testing.assert_close(both.probs[r : r + 1], p.probs, rtol=1e-4, atol=1e-5)
        if p.conf_logits is not None:
            torch.testing.assert_close(both.conf_logits[r : r + 1], p.conf_logits, rtol=1e-4, atol=1e-5)


def test_row_groups_is_the_cheapest_partition():
    """row_groups against brute force over every partition of the sorted rows
    into contiguous groups (the optimum partition of a sorted list is contiguous)."""
    import itertools

    from deepspec.core.batch_cache import row_groups

    rng = np.random.default_rng(1)
    for _ in range(30):
        need = torch.from_numpy(rng.integers(1, 400, size=int(rng.integers(1, 7))))
        over = int(rng.integers(0, 300))
        s = sorted(need.tolist())

        def cost(cuts):
            b = [0, *cuts, len(s)]
            return sum((j - i) * s[j - 1] + over for i, j in zip(b, b[1:]))

        best = min(cost(c) for k in range(len(s)) for c in itertools.combinations(range(1, len(s)), k))
        groups = row_groups(need, over)
        assert sorted(torch.cat([g for g, _ in groups]).tolist()) == list(range(len(s)))
        assert all(keep == int(need[g].max()) for g, keep in groups)
        assert sum(len(g) * keep + over for g, keep in groups) == best


def test_grouped_attention_is_exact(tiny_target, drafters, plain_greedy, monkeypatch):
    """With no per-group overhead every distinct context length attends alone over
    its own keys: the forward's logits equal the padded forward's, and batched
    greedy decoding still equals plain decoding."""
    from deepspec.core import batch_cache

    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 30]
    kv = {}
    for overhead in (None, 0):
        monkeypatch.setattr(batch_cache, "GROUP_OVERHEAD", 10**9 if overhead is None else 0)
        b = BatchKV()
        g.manual_seed(0)
        joining = []
        for n in lengths:
            c = batch_cache.engine_cache()
            decode.target_forward(tiny_target, torch.randint(0, tiny_target.vocab_size, (1, n), generator=g), c, None,
                            last_only=True)
            joining.append((c, n))
        b.add_many(joining)
        ids = torch.randint(0, tiny_target.vocab_size, (4, 5), generator=g)
        kv[overhead] = b.forward(tiny_target, ids, torch.tensor([5, 2, 4, 1]), None)[0]
    assert len(batch_cache.row_groups(torch.tensor(lengths) + 5, 0)) == 4
    torch.testing.assert_close(kv[0], kv[None], rtol=1e-4, atol=1e-4)  # fp32 summation order only
    eng = BatchedEngine(tiny_target, drafters["dspark"], feature_layers=LAYERS, temperature=0.0, max_batch=3)
    got = _by_id(eng.generate([Request(i, p, 14 - 2 * (i % 3)) for i, p in enumerate(PROMPTS + PROMPTS[:2])]))
    assert {i: f.tokens for i, f in got.items()} == plain_greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_gqa_attention_equals_transformers_sdpa(dtype):
    """folded_gqa_sdpa (each K/V head's query heads folded into the query length)
    against transformers' sdpa_attention_forward, which repeats K/V or passes
    enable_gqa: bit for bit with a verification round's mask (left padding, causal
    chunk) and without a mask (non-causal), in fp32 and bf16. Where folding does not
    apply (one query, causal without a mask, a per-head mask, gradients) it is
    transformers' call."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from deepspec.core.batch_cache import folded_gqa_sdpa, grouped_query_sdpa

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for R, Lq, Lk in [(4, 8, 37), (16, 8, 300), (3, 5, 5)]:
        q, k, v = (torch.randn(R, h, n, 16, generator=g).to(dtype) for h, n in ((9, Lq), (3, Lk), (3, Lk)))
        mask = torch.ones(R, 1, Lq, Lk, dtype=torch.bool)
        mask[:, :, :, -Lq:] = torch.ones(Lq, Lq, dtype=torch.bool).tril()
        mask[1:, :, :, :2] = False  # left padding
        for m, causal in ((mask, None), (None, False)):
            got, _ = folded_gqa_sdpa(module, q, k, v, m, scaling=0.25, is_causal=causal)
            for force in (False, True):  # repeat_kv, or torch's enable_gqa
                with grouped_query_sdpa(force):
                    want, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.25, is_causal=causal)
                assert got.shape == want.shape == (R, Lq, 9, 16)
                assert torch.equal(got, want)
    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16)
    per_head = torch.rand(2, 9, 4, 4) > 0.3
    per_head[..., 0] = True
    for m, qq in ((None, q), (per_head, q), (None, q[:, :, :1])):
        with grouped_query_sdpa(True):
            got, _ = folded_gqa_sdpa(module, qq, k, v, m)
            want, _ = sdpa_attention_forward(module, qq, k, v, m)
        assert torch.equal(got, want)
    q.requires_grad_(True)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention",
                   lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
        folded_gqa_sdpa(module, q, k, v, torch.ones(2, 1, 4, 4, dtype=torch.bool)).__getitem__(0).sum().backward()
    assert calls == [torch.Size([2, 9, 4, 16])]  # under autograd: transformers' own call, heads not folded


def test_propose_batch_in_context_length_groups(tiny_target, drafters, monkeypatch):
    """Drafters split the batch by context length (no per-group overhead: every
    length its own group); each row still drafts what it drafts alone."""
    from deepspec.core import batch_cache

    monkeypatch.setattr(batch_cache, "DRAFT_GROUP_OVERHEAD", 0)
    g = torch.Generator().manual_seed(7)
    for m in ("dflash", "dspark", "eagle3"):
        d = drafters[m]
        states, feats, toks = [], [], []
        for n in (5, 2, 9, 2):
            ids = torch.randint(0, tiny_target.vocab_size, (1, n + 1), generator=g)
            feats.append(tiny_target.features(ids[:, :-1], LAYERS)[0])
            states.append(d.init_state())
            toks.append(ids)
        _batch_equals_alone(d, states, feats, toks)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_batched_verification_equals_per_row_bit_for_bit(temperature):
    """decode.verify_rows (every row of a round at once, one host transfer) returns exactly what
    decode.verify_row returns row by row (accepted, emitted tokens, proposal length, a_k, alpha_k as
    floats), and leaves every row's generator where verify_row leaves it; on random rounds with ragged
    lengths (plain-step rows of no drafts included), drafted EOS tokens and confidences riding along."""
    g = torch.Generator().manual_seed(7)
    V, gamma, eos = 50, 5, (3, 4)
    for trial in range(40):
        R = int(torch.randint(1, 7, (1,), generator=g))
        ells = torch.randint(0, gamma + 1, (R,), generator=g).tolist()
        W = 1 + max(ells)
        sharp = 0.3 + 3 * torch.rand((), generator=g)
        logits = torch.randn(R, W, V, generator=g) * sharp
        probs = torch.softmax(logits[:, 1:] + torch.randn(R, W - 1, V, generator=g), -1)  # close to p_t: acceptances
        probs = torch.cat([probs, torch.softmax(torch.randn(R, gamma - (W - 1), V, generator=g), -1)], 1)
        draft = torch.multinomial(probs[:, : W - 1].reshape(-1, V), 1, generator=g).reshape(R, W - 1) if W > 1 \
            else torch.zeros(R, 0, dtype=torch.long)
        if W > 1 and trial % 3 == 0:
            draft[0, (W - 2) // 2] = eos[trial % 2]
        if temperature == 0.0 and W > 1:  # greedy: make some drafts the argmax
            hit = torch.rand(R, W - 1, generator=g) < 0.7
            draft = torch.where(hit, logits[:, : W - 1].argmax(-1), draft)
        conf = torch.randn(R, gamma, generator=g)
        seeds = torch.randint(0, 2**31, (R,), generator=g).tolist()
        gens_a = [torch.Generator().manual_seed(s) for s in seeds]
        gens_b = [torch.Generator().manual_seed(s) for s in seeds]
        rows = [decode.verify_row(logits[r : r + 1, : 1 + ell], probs[r : r + 1, :ell], draft[r : r + 1, :ell],
                                  temperature=temperature, eos_token_ids=eos, generator=gens_a[r])
                for r, ell in enumerate(ells)]
        batched, accepted, extra = decode.verify_rows(logits, None if W == 1 and trial % 2 else probs, draft, ells,
                                                      temperature=temperature, eos_token_ids=eos, generators=gens_b,
                                                      extra=conf)
        assert batched == rows, (trial, ells)
        assert accepted.tolist() == [r[0] for r in rows] and extra == conf.tolist()
        for ga, gb in zip(gens_a, gens_b):  # the same draws were consumed
            assert torch.equal(torch.rand(3, generator=ga, dtype=torch.float64),
                               torch.rand(3, generator=gb, dtype=torch.float64))


def test_engine_refuses_bad_prompts_in_one_line(tiny_target, monkeypatch):
    """An empty prompt was a bare RuntimeError from the target; one longer than
    the target's context was decoded without a word. Both are refused before
    any request is decoded."""
    from deepspec.errors import DeepSpecError

    eng = BatchedEngine(tiny_target, None, feature_layers=LAYERS, max_batch=2)
    seen = []
    ok = Request("ok", PROMPT, 2)
    for bad, match in ((Request("empty", [], 2), "request 'empty': empty prompt"),
                       (Request("oov", [1, tiny_target.vocab_size], 2), "token id .* outside the target vocabulary")):
        with pytest.raises(DeepSpecError, match=match) as e:
            eng.generate([ok, bad], on_finish=seen.append)
        assert "\n" not in str(e.value) and not seen
    monkeypatch.setattr(tiny_target.text_config, "max_position_embeddings", len(PROMPT) - 1)
    assert tiny_target.context_length == len(PROMPT) - 1
    with pytest.raises(DeepSpecError, match=f"prompt of {len(PROMPT)} tokens is longer than the context") as e:
        eng.generate([Request("long", PROMPT, 2)], on_finish=seen.append)
    assert "\n" not in str(e.value) and not seen
    monkeypatch.setattr(tiny_target.text_config, "max_position_embeddings", len(PROMPT))
    assert len(eng.generate([Request("fits", PROMPT, 2)])) == 1


def test_kv_budget_arithmetic_and_measured_bytes_per_token(tiny_target, gemma4_target):
    """A row's slot bound: its tokens, two chunks, the share compaction leaves, the buffers' room on both
    sides. The KV bytes per position are measured on the first prefill's cache as stored: Gemma4's
    full-attention layers have a wider head and one K/V head (reading the config's global
    num_key_value_heads raised on Gemma4, and head_dim alone would have counted half their bytes)."""
    from deepspec.targets.tiny import TINY_CONFIG, TINY_GEMMA4_CONFIG

    assert row_slots(100, 8) == 155 + 2 * 77  # ceil(116 / 0.75) slots, room min(155 // 2, 512) each side
    assert row_slots(6000, 8) == 8022 + 2 * 512 and row_slots(1, 1) == 4 + 2 * 64
    c, g = TINY_CONFIG, TINY_GEMMA4_CONFIG
    hd = c["hidden_size"] // c["num_attention_heads"]
    heads = [(c["num_key_value_heads"], hd)] * c["num_hidden_layers"]
    g_heads = [(g["num_global_key_value_heads"], g["global_head_dim"]) if t == "full_attention"
               else (g["num_key_value_heads"], g["head_dim"]) for t in g["layer_types"]]
    for target, per_layer in ((tiny_target, heads), (gemma4_target, g_heads)):
        eng = BatchedEngine(target, None, feature_layers=LAYERS, max_batch=2)
        assert eng.kv_per_token is None and eng.row_bytes(Request(0, [5] * 7, 2)) is None
        eng.generate([Request(0, [5] * 7, 2)])
        assert eng.kv_per_token == sum(2 * h * d * 4 for h, d in per_layer)  # K and V, fp32
        assert eng.row_bytes(Request(0, [5] * 30, 10)) == row_slots(40, 1) * eng.kv_per_token


def test_admission_counts_the_drafters_context_kv(tiny_target, tiny_cfg):
    """P4: a block drafter keeps K/V for every draft layer over each request's context;
    the engine's bytes per position (its KV budget's unit) are the target's plus those."""
    from helpers import random_drafter

    plain = BatchedEngine(tiny_target, None, feature_layers=LAYERS, max_batch=2)
    plain.generate([Request(0, [5] * 7, 2)])
    d, _ = random_drafter("dflash", tiny_target, tiny_cfg)
    eng = BatchedEngine(tiny_target, d, feature_layers=tiny_cfg["target"]["feature_layers"], max_batch=2)
    eng.generate([Request(0, [5] * 7, 2)])
    assert d.kv_bytes_per_token() > 0 and eng.kv_per_token == plain.kv_per_token + d.kv_bytes_per_token()


def test_engine_keeps_the_batch_within_the_kv_budget(tiny_target, monkeypatch):
    """With eval.kv_budget_gb's bytes, a queued request joins only while every row padded to the
    longest request among them fits: short requests share 4 rows, the long ones run alone, the
    cache's buffers never hold more than the budget while rows share it, and every output is the
    unbudgeted engine's (greedy: plain decoding)."""
    short, long_ = [Request(i, PROMPTS[i % 4], 6) for i in range(6)], [Request(6 + i, PROMPT * 40, 6) for i in range(2)]
    reqs = short + long_
    drafter = DistortedTargetDrafter(tiny_target, LAYERS, gamma=2)
    free = BatchedEngine(tiny_target, drafter, feature_layers=LAYERS, temperature=0.0, max_batch=8)
    want = {f.request.request_id: f.tokens for f in free.generate(reqs)}
    assert free.stats["max_rows"] == 8
    per_token = free.kv_per_token
    short_row = max(free.row_bytes(r) for r in short)
    budget = 4.5 * short_row
    assert 2 * free.row_bytes(long_[0]) > budget  # a long request fits alone only
    held, forward = [], BatchKV.forward

    def spy(kv, target, ids, widths, layers):
        out = forward(kv, target, ids, widths, layers)
        bufs = [getattr(layer, name) for layer in kv.cache.layers for name in ("_kbuf", "_vbuf") if hasattr(layer, name)]
        held.append((ids.shape[0], sum(b.numel() * b.element_size() for b in bufs)))
        return out

    monkeypatch.setattr(BatchKV, "forward", spy)
    eng = BatchedEngine(tiny_target, drafter, feature_layers=LAYERS, temperature=0.0, max_batch=8,
                        kv_budget_bytes=budget)
    got = _by_id(eng.generate(reqs))
    assert {i: f.tokens for i, f in got.items()} == want and eng.kv_per_token == per_token
    assert eng.stats["max_rows"] == 4
    assert all(r["batch_size"] == 1 for f in long_ for r in got[f.request_id].rounds)
    assert all(b <= budget for R, b in held if R > 1) and held

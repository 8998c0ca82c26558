"""Losses (deepspec/core/losses.py) against hand-computed values; anchors and
block targets; the training step's loss composition (Eq. 12), chunking and
the p_t table (deepspec/core/train_step.py)."""
import dataclasses
import math

import pytest
import torch

from deepspec.core import losses, train_step
from deepspec.core.train_step import StepSpec, block_targets, sample_anchors
from deepspec.drafters import build_drafter
from deepspec.training.run import step_spec


def test_token_terms_hand_computed():
    # p_d = softmax(log(0.5, 0.25, 0.25)); p_t = (0.7, 0.2, 0.1); label = 1
    logp = torch.log_softmax(torch.tensor([[[math.log(0.5), math.log(0.25), math.log(0.25)]]]), -1)
    pt = torch.tensor([[[0.7, 0.2, 0.1]]])
    ce, l1, cstar, inv = losses.token_terms(logp, torch.tensor([[1]]), pt, None)
    assert ce.item() == pytest.approx(-math.log(0.25))
    assert l1.item() == pytest.approx(0.2 + 0.05 + 0.15)  # full L1, not halved
    assert cstar.item() == pytest.approx(0.5 + 0.2 + 0.1)  # sum min = 1 - L1/2
    assert inv.item() == 1.0


def test_reduced_vocab_terms_count_unreachable_mass(tiny_target, tiny_cfg):
    # draft vocab = target ids (2, 5); target mass 0.1 sits on id 7 (unreachable)
    cfg = {**tiny_cfg, "drafter": {**tiny_cfg["drafter"], "draft_vocab_size": 2}}
    counts = torch.zeros(tiny_target.vocab_size)
    counts[2], counts[5] = 2, 1
    d = build_drafter("dspark", tiny_target, cfg, token_counts=counts)
    assert d.d2t.tolist() == [2, 5]
    logp = torch.log_softmax(torch.tensor([[[0.0, 0.0]]]), -1)  # p_d = (0.5, 0.5) on ids (2, 5)
    pt_full = torch.zeros(1, 1, tiny_target.vocab_size)
    pt_full[0, 0, 2], pt_full[0, 0, 5], pt_full[0, 0, 7] = 0.6, 0.3, 0.1
    pt, out_mass = d.restrict_to_draft_vocab(pt_full)
    ce, l1, cstar, inv = losses.token_terms(logp, d.to_draft_ids(torch.tensor([[7]])), pt, out_mass)
    assert l1.item() == pytest.approx(0.1 + 0.2 + 0.1)
    assert cstar.item() == pytest.approx(0.5 + 0.3)
    assert inv.item() == 0.0  # label outside the draft vocab: no CE term
    sce, cs = losses.soft_ce_terms(logp, pt)
    assert sce.item() == pytest.approx(-(0.6 + 0.3) * math.log(0.5))


def test_weighted_mean_over_valid_positions():
    w = torch.exp(-torch.arange(3) / 4.0)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    valid = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    W = w * valid
    want = (1 * w[0] + 2 * w[1] + 4 * w[0]) / (2 * w[0] + w[1])
    assert losses.weighted_mean(x, W).item() == pytest.approx(want.item())


def test_sample_anchors_eligibility_and_determinism():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    am = torch.ones_like(lm)
    a, v = sample_anchors(lm, am, 10, torch.Generator().manual_seed(0))
    assert a.shape == (2, 3)
    assert a[0].tolist() == [1, 2, 5] and v[0].all()  # p with loss_mask[p] and loss_mask[p+1]
    assert a[1, v[1]].tolist() == [3] and v[1].sum() == 1
    a2, _ = sample_anchors(lm, am, 2, torch.Generator().manual_seed(0))
    a3, _ = sample_anchors(lm, am, 2, torch.Generator().manual_seed(0))
    assert torch.equal(a2, a3) and a2.shape == (2, 2)
    assert set(a2[0].tolist()) <= {1, 2, 5}


def test_block_targets_contiguous_prefix():
    ids = torch.arange(10, 20).unsqueeze(0)
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    labels, valid, src, prev = block_targets(ids, lm, None, torch.tensor([[1, 7]]), torch.tensor([[True, True]]), 4)
    assert labels[0, 0].tolist() == [12, 13, 14, 15]
    assert valid[0, 0].tolist() == [True, True, False, False]  # stops at the loss-mask gap, never resumes
    assert valid[0, 1].tolist() == [True, True, False, False]  # past the sequence end
    assert src[0, 0].tolist() == [1, 2, 3, 4]  # the target predicted token p+1+j at p+j
    assert prev[0, 0].tolist() == [11, 12, 13, 14]  # anchor, then teacher-forced labels


@pytest.fixture(scope="module")
def batch(tiny_target, tiny_cfg):
    ids = torch.tensor([[1, 2, 3, 500, 17, 923, 4411, 60, 7, 311, 2999, 12, 40, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0, 0]])
    am = torch.ones_like(ids, dtype=torch.bool)
    am[1, 9:] = False
    lm = am.clone()
    lm[:, :3] = False
    feats, last = tiny_target.features(ids, tiny_cfg["target"]["feature_layers"], attention_mask=am)
    return dict(input_ids=ids, loss_mask=lm, attention_mask=am, features=feats, last_hidden=last)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_training_step_composition(tiny_target, tiny_cfg, batch, method):
    torch.manual_seed(0)
    d = build_drafter(method, tiny_target, tiny_cfg)
    loss, m = d.training_step(batch, step_spec(tiny_cfg), torch.Generator().manual_seed(0))
    g = d.gamma
    assert all(f"c_star_{k}" in m for k in range(1, g + 1))
    cs = torch.tensor([m[f"c_star_{k}"] for k in range(1, g + 1)])
    assert m["tau_expected"] == pytest.approx(1 + torch.cumprod(cs, 0).sum().item(), rel=1e-5)
    L = tiny_cfg["loss"]
    if method == "dflash":
        assert loss.item() == pytest.approx(m["loss_ce"]) and "loss_l1" not in m
    elif method == "dspark":
        want = L["ce_alpha"] * m["loss_ce"] + L["l1_alpha"] * m["loss_l1"] + L["conf_alpha"] * m["loss_conf"]
        assert loss.item() == pytest.approx(want, rel=1e-5)
        assert 0 < m["n_anchors"] <= 2 * tiny_cfg["train"]["num_anchors"]
    else:
        want = sum(L["eagle3_step_decay"] ** s * m[f"loss_step_{s + 1}"] for s in range(g))
        assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    grads = [p.grad for p in d.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads)
    assert any(x.abs().sum() > 0 for x in grads)


def _loss_metrics_grads(method, target, cfg, batch, **spec):
    """One seeded training step: (loss, metrics, flattened gradients); `spec`
    overrides StepSpec fields (chunk_positions, pt_table_bytes)."""
    torch.manual_seed(0)
    d = build_drafter(method, target, cfg)
    loss, m = d.training_step(batch, dataclasses.replace(step_spec(cfg), **spec), torch.Generator().manual_seed(0))
    loss.backward()
    return loss.detach(), m, torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])


def test_chunking_does_not_change_loss_or_grads(tiny_target, tiny_cfg, batch):
    l0, _, g0 = _loss_metrics_grads("dspark", tiny_target, tiny_cfg, batch)
    l1, _, g1 = _loss_metrics_grads("dspark", tiny_target, tiny_cfg, batch, chunk_positions=7)  # one block per chunk
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-5)


def test_eagle3_precomputed_target_probs_match_per_step(tiny_target, tiny_cfg, batch):
    """p_t computed once per position (the fast path) equals p_t computed per TTT step."""
    l0, m0, g0 = _loss_metrics_grads("eagle3", tiny_target, tiny_cfg, batch)
    # the per-step path, in checkpointed chunks
    l1, m1, g1 = _loss_metrics_grads("eagle3", tiny_target, tiny_cfg, batch, pt_table_bytes=0, chunk_positions=5)
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-5)
    assert m0["c_star_1"] == pytest.approx(m1["c_star_1"], abs=1e-6)


def test_eagle3_step_keeps_head_graphs_when_they_fit_and_reads_only_needed_positions(tiny_target, tiny_cfg, batch,
                                                                                     monkeypatch):
    """All TTT steps' rows within one chunk: the heads keep their graphs (no
    checkpoint, no recomputation in the backward); one row fewer: each step's head
    is checkpointed. Same loss and gradients. The p_t table holds only the positions
    some step reads (none of the prompt's first tokens, no padding)."""
    rows, calls = [], []
    real_pt, real_ckpt = train_step._restricted_pt, train_step.checkpoint
    monkeypatch.setattr(train_step, "_restricted_pt",
                        lambda d, x, c, z=None: rows.append(x.shape[0]) or real_pt(d, x, c, z))
    monkeypatch.setattr(train_step, "checkpoint", lambda *a, **k: calls.append(1) or real_ckpt(*a, **k))
    _, m, _ = _loss_metrics_grads("eagle3", tiny_target, tiny_cfg, batch)
    n = int(m["n_positions"])
    l0, _, g0 = _loss_metrics_grads("eagle3", tiny_target, tiny_cfg, batch, chunk_positions=n)
    assert not calls
    l1, _, g1 = _loss_metrics_grads("eagle3", tiny_target, tiny_cfg, batch, chunk_positions=n - 1)
    assert len(calls) == 7
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-5)
    # read: position p = t+1+s for rows t with the loss mask at t+s (t+s < length-1)
    lm, am = batch["loss_mask"], batch["attention_mask"]
    want = sum(int((lm[b, :-1] & am[b, 1:]).sum()) for b in range(lm.shape[0]))
    assert rows[0] == want < batch["input_ids"].numel()


@pytest.mark.parametrize("vocab", [None, 64])
def test_block_target_probs_once_per_position_match_per_slot(tiny_target, tiny_cfg, batch, vocab):
    """p_t computed once per distinct (sequence, position) and gathered equals
    p_t computed for every block slot, with the full and a reduced draft vocabulary."""
    cfg = {**tiny_cfg, "drafter": {**tiny_cfg["drafter"], "draft_vocab_size": vocab}}
    counts = torch.arange(tiny_target.vocab_size, 0, -1) if vocab else None
    d = build_drafter("dspark", tiny_target, cfg, token_counts=counts)
    anchors, ok = sample_anchors(batch["loss_mask"], batch["attention_mask"], 8, torch.Generator().manual_seed(0))
    _, _, src, _ = block_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], anchors, ok, d.gamma)
    pt, out, idx = train_step.block_target_probs(d, batch["last_hidden"], src, ok, StepSpec())
    assert pt.shape[0] < idx.numel()  # overlapping blocks share rows
    pt, out = pt[idx], None if out is None else out[idx]
    want_pt, want_out = d.restrict_to_draft_vocab(d.target_probs(train_step._gather_rows(batch["last_hidden"], src)[ok]))
    assert torch.allclose(pt, want_pt, atol=1e-7)
    assert (out is None and want_out is None) or torch.allclose(out, want_out, atol=1e-7)
    assert (out is None) == (vocab is None)


def test_block_step_without_the_precomputed_table(tiny_target, tiny_cfg, batch):
    """Too large a p_t table falls back to per-chunk p_t: same loss, gradients, c*."""
    l0, m0, g0 = _loss_metrics_grads("dspark", tiny_target, tiny_cfg, batch)
    l1, m1, g1 = _loss_metrics_grads("dspark", tiny_target, tiny_cfg, batch, pt_table_bytes=0, chunk_positions=7)
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-5)
    assert m0["c_star_2"] == pytest.approx(m1["c_star_2"], abs=1e-6)


def test_dflash_skips_target_head_off_log_steps(tiny_target, tiny_cfg, batch, monkeypatch):
    """DFlash's loss is CE only: off log steps p_t is not computed at all, and
    the loss and gradients are those of a log step."""
    l0, m0, g0 = _loss_metrics_grads("dflash", tiny_target, tiny_cfg, batch)
    assert "c_star_1" in m0
    calls = []
    monkeypatch.setattr(train_step, "block_target_probs", lambda *a: calls.append(1))
    torch.manual_seed(0)
    d = build_drafter("dflash", tiny_target, tiny_cfg)
    loss, m = d.training_step(batch, step_spec(tiny_cfg), torch.Generator().manual_seed(0), log_step=False)
    loss.backward()
    g1 = torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
    assert not calls and "c_star_1" not in m and m["n_anchors"] == m0["n_anchors"]
    assert torch.allclose(l0, loss.detach(), atol=1e-7) and torch.allclose(g0, g1, atol=1e-7)


def _reduced(tiny_target, tiny_cfg, method, K=64):
    cfg = {**tiny_cfg, "drafter": {**tiny_cfg["drafter"], "draft_vocab_size": K}}
    torch.manual_seed(0)
    return build_drafter(method, tiny_target, cfg, token_counts=torch.arange(tiny_target.vocab_size, 0, -1))


def test_draft_vocab_target_probs_from_the_log_normalizer(tiny_target, tiny_cfg, batch):
    """p_t on the draft vocabulary from its K logits and the target's log-normalizer
    equals the full softmax restricted to it, and so does the mass outside."""
    d = _reduced(tiny_target, tiny_cfg, "dspark", K=tiny_target.vocab_size // 4)
    x = batch["last_hidden"]
    lse = tiny_target.log_normalizer(x)
    assert lse.shape == x.shape[:-1] and lse.dtype == torch.float32
    want_pt, want_out = d.restrict_to_draft_vocab(d.target_probs(x))
    pt, out = d.draft_vocab_target_probs(x, lse)
    assert torch.allclose(pt, want_pt, rtol=1e-5, atol=1e-8) and torch.allclose(out, want_out, atol=1e-5)
    assert 0.1 < float(out.mean()) < 0.9  # a reduced vocabulary with mass outside it


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
@pytest.mark.parametrize("table", [True, False])
def test_training_step_with_cached_log_normalizers(tiny_target, tiny_cfg, batch, method, table, monkeypatch):
    """With target_lse in the batch (the cache's), a step never runs the full-vocabulary
    head, and its loss, gradients and c* are those computed from all V logits,
    with the shared p_t table and without it."""
    spec = dataclasses.replace(step_spec(tiny_cfg), **({} if table else {"pt_table_bytes": 0, "chunk_positions": 7}))

    def step(b):
        d = _reduced(tiny_target, tiny_cfg, method)
        loss, m = d.training_step(b, spec, torch.Generator().manual_seed(0))
        loss.backward()
        return loss.detach(), m, torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])

    l0, m0, g0 = step(batch)
    lse = tiny_target.log_normalizer(batch["last_hidden"]).masked_fill(~batch["attention_mask"], 0.0)
    monkeypatch.setattr(type(_reduced(tiny_target, tiny_cfg, method)), "target_probs",
                        lambda *a: pytest.fail("the full-vocabulary head ran"))
    l1, m1, g1 = step({**batch, "target_lse": lse})
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-6) and torch.allclose(g0, g1, rtol=1e-4, atol=1e-6)
    l2, _, g2 = step({**batch, "target_lse": lse})
    assert torch.equal(l1, l2) and torch.equal(g1, g2)  # seeded: bit for bit again
    for k in (1, 2, 3):
        assert m1[f"c_star_{k}"] == pytest.approx(m0[f"c_star_{k}"], abs=1e-5)

"""GPU-efficient training, checked on CPU.

* Attention: the block drafters' training mask as a flex_attention BlockMask
  (`dflash.block_flex_mask`, the CUDA path) expresses exactly the dense mask of
  `dflash.block_attention_mask` (the CPU path), and the flex path gives the same
  drafter outputs. flex_attention runs forward only on CPU in torch 2.13 ("does
  not support backward on CPU"): gradients are compared by the CUDA-only test
  here, which benchmarks/device_check.sh runs on a GPU.
* Memory: at Qwen3's 151,936-token vocabulary a training step (forward and
  backward) never holds more vocabulary-sized memory than
  `train_step.vocab_peak_bytes` (the p_t table within its budget plus one head
  chunk), far below a whole batch's [anchors x gamma, V] fp32.
* bf16: a training step under bf16 autocast (the trainer's GPU setting; CPU
  autocast here) has a finite loss and gradients close to fp32's.
"""
import dataclasses

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from deepspec.core import train_step
from deepspec.core.train_step import sample_anchors
from deepspec.drafters import build_drafter
from deepspec.drafters.dflash import block_attention_mask, block_flex_mask, block_mask_mod
from deepspec.training.run import step_spec

QWEN3_VOCAB = 151_936


def _anchors(B, N, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(L - 1, generator=g)[:N].sort().values for _ in range(B)])


@pytest.mark.parametrize("B,N,L,gamma", [(1, 1, 5, 7), (2, 5, 40, 7), (3, 9, 200, 4), (2, 40, 300, 7)])
def test_block_mask_mod_equals_dense_mask(B, N, L, gamma):
    anchors = _anchors(B, N, L)
    dense = block_attention_mask(anchors, L, gamma)
    evaluated = create_mask(block_mask_mod(anchors, L, gamma), B, 1, N * gamma, L + N * gamma, device="cpu")
    assert torch.equal(evaluated, dense)


@pytest.mark.parametrize("block_size", [8, 128])
def test_block_mask_tiles_match_dense_mask(block_size):
    """The BlockMask's tiles: a tile is computed iff the dense mask has a True in
    it, and a tile marked full (no mask_mod evaluated) is all True."""
    B, N, L, g = 2, 40, 300, 7
    anchors = _anchors(B, N, L, seed=1)
    dense = block_attention_mask(anchors, L, g)[:, 0]
    bm = block_flex_mask(anchors, L, g, block_size=block_size)
    Q, K = dense.shape[1:]
    nq, nk = -(-Q // block_size), -(-K // block_size)
    padded = torch.zeros(B, nq * block_size, nk * block_size, dtype=torch.bool)
    padded[:, :Q, :K] = dense
    tiles = padded.view(B, nq, block_size, nk, block_size)
    assert torch.equal(bm.to_dense()[:, 0].bool(), tiles.any(4).any(2))
    full = torch.ones(B, nq * block_size, nk * block_size, dtype=torch.bool)
    full[:, :Q, :K] = dense
    full = full.view(B, nq, block_size, nk, block_size).all(4).all(2)
    for b in range(B):
        for i in range(nq):
            for j in bm.full_kv_indices[b, 0, i, : bm.full_kv_num_blocks[b, 0, i]].tolist():
                assert full[b, i, j]


def _block_batch(target, cfg, L=24, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (B, L), generator=g)
    am = torch.ones_like(ids, dtype=torch.bool)
    am[B - 1, L - 5 :] = B == 1  # the last row padded (B > 1)
    lm = am.clone()
    lm[:, :4] = False
    feats, last = target.features(ids, cfg["target"]["feature_layers"], attention_mask=am)
    return dict(input_ids=ids, loss_mask=lm, attention_mask=am, features=feats, last_hidden=last)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_flex_forward_equals_sdpa(target, target_cfg, method):
    """The training pass through flex_attention (BlockMask) equals the sdpa pass
    with the dense mask (CPU forward; on Gemma4 too: scale 1, one K/V head)."""
    torch.manual_seed(0)
    d = build_drafter(method, target, target_cfg)
    batch = _block_batch(target, target_cfg)
    anchors, _ = sample_anchors(batch["loss_mask"], batch["attention_mask"], 6, torch.Generator().manual_seed(0))
    args = (batch["input_ids"], batch["features"], anchors, batch["attention_mask"])
    assert isinstance(d.training_mask(anchors, 24), torch.Tensor)  # "auto" on CPU: the dense mask
    with torch.no_grad():
        h_sdpa = d(*args)
        d.attention_backend = "flex"
        h_flex = d(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # flex casts q/k/v to the autocast dtype
            h_flex16 = d(*args)
            d.attention_backend = "sdpa"
            h_sdpa16 = d(*args)
    assert (h_flex - h_sdpa).abs().max().item() < 5e-5  # measured <= 6e-6
    # under bf16 both paths are as far from fp32 as bf16 makes them
    err16 = (h_sdpa16.float() - h_sdpa).abs().max().item()
    assert (h_flex16.float() - h_sdpa).abs().max().item() <= 2 * err16, err16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU (torch 2.13): "
                    "gradients are compared on CUDA (benchmarks/device_check.sh)")
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_flex_training_step_equals_sdpa_cuda(qwen3_target, qwen3_cfg, method):
    """CUDA: a whole training step (forward and backward) through compiled flex
    equals the sdpa step (fp32)."""
    batch = _block_batch(qwen3_target, qwen3_cfg, L=200)
    out = {}
    for backend in ("sdpa", "flex"):
        torch.manual_seed(0)
        d = build_drafter(method, qwen3_target, qwen3_cfg).cuda()
        d.attach_target(_cuda_target(qwen3_target))
        d.attention_backend = backend
        spec = dataclasses.replace(step_spec(qwen3_cfg), num_anchors=16)
        loss, _ = d.training_step(batch, spec, torch.Generator().manual_seed(0))
        loss.backward()
        out[backend] = loss.detach(), torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
    assert torch.allclose(out["flex"][0], out["sdpa"][0], atol=1e-4)
    assert torch.allclose(out["flex"][1], out["sdpa"][1], atol=1e-3, rtol=1e-2)


def _cuda_target(target):
    import copy

    t = copy.copy(target)
    t.model = copy.deepcopy(target.model).cuda()
    return t


# -- memory at Qwen3's vocabulary ------------------------------------------------------------


class _LargestOutput(TorchDispatchMode):
    """The largest new storage any op allocates (views and in-place results,
    which alias an input, e.g. the transposed LM head, are not allocations)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


def _measured_step(drafter, batch, spec):
    """One training step, forward and backward: (peak bytes allocated during it
    on CPU less the parameter gradients, largest single tensor bytes, metrics)."""
    drafter.zero_grad(set_to_none=True)
    largest = _LargestOutput()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, largest:
        loss, m = drafter.training_step(batch, spec, torch.Generator().manual_seed(0))
        loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in drafter.parameters() if p.grad is not None)
    return peak - 2 * grads, largest.bytes, m  # parameter gradients and one accumulation temporary each


@pytest.fixture(scope="module")
def qwen3_vocab_setup(qwen3_cfg):
    """A tiny Qwen3 target with Qwen3's 151,936-token vocabulary and one batch."""
    from deepspec.core.target import Target, eos_ids_of
    from deepspec.targets.tiny import build_tiny

    model = build_tiny("qwen3", vocab_size=QWEN3_VOCAB).eval().requires_grad_(False)
    target = Target(model=model, tokenizer=None, target_id="tiny-qwen3-v151936", eos_token_ids=eos_ids_of(model, None))
    return target, qwen3_cfg, _block_batch(target, qwen3_cfg, L=80, B=1)


def test_block_step_vocab_memory_bounded_at_qwen3_vocab(qwen3_vocab_setup):
    """DSpark (CE + L1 + c*, the most vocabulary-hungry loss), 24 anchors x 7:
    the step's extra memory stays within `vocab_peak_bytes`, with the p_t table
    over budget (the paper-scale case) and within it; a whole-batch head (one
    chunk of all 168 slots) is measured above that bound."""
    target, cfg, batch = qwen3_vocab_setup
    V = target.vocab_size
    torch.manual_seed(0)
    # a small Markov rank: its [V, r] gradients are parameter memory, not the head's
    d = build_drafter("dspark", target, {**cfg, "drafter": {**cfg["drafter"], "markov_rank": 4}})
    base = dataclasses.replace(step_spec(cfg), num_anchors=24)
    row = V * 4
    slots = 24 * d.gamma
    chunked = dataclasses.replace(base, chunk_positions=d.gamma, pt_table_bytes=0)  # one block per chunk
    bound = train_step.vocab_peak_bytes(chunked, V)
    assert slots * row > bound  # a naive full-batch [anchors x 7, V] fp32 tensor would not fit
    peak, largest, m = _measured_step(d, batch, chunked)
    assert m["n_anchors"] == 24
    param = max(p.numel() * p.element_size() for p in d.parameters())  # e.g. the Markov W1 [V, r] gradient
    assert largest <= max(d.gamma * row, param) and peak <= bound, (largest / row, peak / row)
    # the p_t table within its budget: table (distinct positions) + one chunk
    tabled = dataclasses.replace(chunked, pt_table_bytes=1 << 30)
    peak_t, largest_t, _ = _measured_step(d, batch, tabled)
    assert peak_t <= train_step.vocab_peak_bytes(tabled, V, table_rows=batch["input_ids"].numel())
    # the measurement sees a whole-batch head: all slots in one chunk exceed the bound
    whole = dataclasses.replace(chunked, chunk_positions=slots)
    peak_w, largest_w, _ = _measured_step(d, batch, whole)
    assert largest_w >= slots * row and peak_w > bound


def test_chain_step_vocab_memory_bounded_at_qwen3_vocab(qwen3_vocab_setup):
    """Eagle3, 7 TTT steps over 40 positions: one chunk's working set at a time
    (the p_t table is read by row index inside the chunks, and the steps'
    single chunks are checkpointed), not 7 steps' [rows, V] graphs."""
    target, cfg, batch = qwen3_vocab_setup
    batch = {k: v[:, :40] for k, v in batch.items()}
    V = target.vocab_size
    torch.manual_seed(0)
    d = build_drafter("eagle3", target, cfg)
    spec = dataclasses.replace(step_spec(cfg), chunk_positions=8, pt_table_bytes=0)
    peak, largest, _ = _measured_step(d, batch, spec)
    assert largest <= 8 * V * 4 and peak <= train_step.vocab_peak_bytes(spec, V)
    spec = dataclasses.replace(spec, chunk_positions=64, pt_table_bytes=1 << 30)  # one chunk per step, table
    peak, _, _ = _measured_step(d, batch, spec)
    assert peak <= train_step.vocab_peak_bytes(spec, V, table_rows=batch["input_ids"].numel())


# -- bf16 autocast -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle3"])
def test_bf16_autocast_training_step_close_to_fp32(tiny_target, tiny_cfg, method):
    """The trainer's bf16 autocast (GPU) on CPU: finite loss and gradients; loss
    within 2 % of fp32 and gradients with cosine similarity > 0.99."""
    batch = _block_batch(tiny_target, tiny_cfg, L=40)
    out = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        d = build_drafter(method, tiny_target, tiny_cfg)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _ = d.training_step(batch, step_spec(tiny_cfg), torch.Generator().manual_seed(0))
        loss.backward()
        out[dtype] = loss.detach().float(), torch.cat([p.grad.float().flatten() for p in d.parameters()
                                                        if p.grad is not None])
    (l32, g32), (l16, g16) = out[None], out[torch.bfloat16]
    assert torch.isfinite(l16) and torch.isfinite(g16).all()
    assert abs(l16 - l32) <= 0.02 * abs(l32), (l16, l32)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99


def test_flex_only_for_head_dims_its_kernels_fit():
    """R5: "auto" trains through flex on CUDA up to head_dim 256 (Qwen3: 128) and
    through sdpa beyond (Gemma4's full-attention heads: 512), never on the CPU;
    "flex" / "sdpa" force one."""
    from deepspec.drafters.blocks import uses_flex

    assert uses_flex("auto", "cuda", 128) and uses_flex("auto", "cuda", 256)
    assert not uses_flex("auto", "cuda", 512) and not uses_flex("auto", "cpu", 128)
    assert uses_flex("flex", "cuda", 512) and uses_flex("flex", "cpu", 64)
    assert not uses_flex("sdpa", "cuda", 128)


@pytest.mark.parametrize("kind,head_dim", [("qwen3", 16), ("gemma4", 32)])
def test_training_mask_asks_with_the_draft_head_dim(kind, head_dim, request, monkeypatch):
    """The block drafters choose their training attention from the draft layers'
    head_dim (Gemma4: global_head_dim, the draft's full-attention geometry)."""
    from deepspec.drafters import dflash

    target, cfg = request.getfixturevalue(f"{kind}_target"), request.getfixturevalue(f"{kind}_cfg")
    torch.manual_seed(0)
    d = build_drafter("dflash", target, cfg)
    seen = []
    monkeypatch.setattr(dflash, "uses_flex", lambda backend, dev, hd: seen.append((backend, dev, hd)) or False)
    assert isinstance(d.training_mask(_anchors(1, 2, 24), 24), torch.Tensor)
    assert seen == [("auto", "cpu", head_dim)]

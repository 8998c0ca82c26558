"""Running a training step at paper dimensions without weights: the `meta`
device with value shadows (used by `deepspec.planning.plan`). Below the
machinery, what plan measures with it: a drafter built on meta
(`build_meta_drafter`, `param_counts`), a synthetic micro-batch
(`synthetic_batch`), one real training step (`measure_step`) and the target
forward that online mode adds (`measure_target_forward`).

Meta tensors have shapes but no values, so the few data-dependent operations
of a training step cannot run on them as they are: `.item()` (anchor counts),
boolean indexing (`h[valid]`), `torch.unique` (the shared p_t table), `.any()`
checks. They only ever depend on *small integer data* - token ids, masks,
anchor draws, index arithmetic - never on the float activations, whose values
do not change any shape. `MetaShadow` is a TorchDispatchMode that keeps a CPU
copy (a "shadow") beside every meta tensor derived only from such small data
(CPU inputs moved to meta, meta factories such as ``arange``), computes each op
on the shadows as well when all its meta inputs have one, and uses them to
answer the data-dependent ops: ``_local_scalar_dense`` returns the shadow's
value, ops without a meta kernel (nonzero, unique, masked_select, ...) run on
the shadows and return a meta tensor of the resulting shape, and boolean
indices of ``index`` / ``index_put`` are turned into integer indices. Float
tensors that descend from weights or cached features never get a shadow (they
are big and their values irrelevant); a scalar read from one (only logged
metrics do this) is 0.0 and counted in `unknown_scalars`.

Meta tensors always take SDPA's math path, which materialises the attention
scores and saves the probabilities for backward; on a GPU a fused kernel
(memory-efficient, flash, flex) keeps only the output and the log-sum-exp.
`fused_attention()` routes SDPA calls on meta tensors to the memory-efficient
kernel's own meta implementation (`aten._scaled_dot_product_efficient_attention`,
whose forward and backward FLOPs the flop counter knows), so that memory is
that of the GPU path; its FLOPs are those of dense attention.

Under `FlopCounterMode` entered *inside* a MetaShadow, every op is counted once
at its meta shapes and the shadow computations are not counted.
`SavedBytes` (torch.autograd.graph.saved_tensors_hooks) sums the unique
storages autograd keeps for the backward pass.
"""
from __future__ import annotations

import contextlib
import time
from typing import Mapping

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from ..core.target import Target
from ..settings import Settings

aten = torch.ops.aten

SHADOW_MAX_NUMEL = 1 << 24  # larger integer / bool tensors get no shadow (and need none); floats: 1/16 of it
# factories whose values are undefined: their outputs get no shadow
_NO_VALUES = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


class MetaShadow(TorchDispatchMode):
    """See the module docstring. `largest_bytes` is the largest tensor any op
    produced on meta (a transient-memory term); `unknown_scalars` counts
    scalars read from tensors without a shadow."""

    def __init__(self, max_numel: int = SHADOW_MAX_NUMEL):
        super().__init__()
        self.max_numel = max_numel
        self.shadow = WeakTensorKeyDictionary()
        self.largest_bytes = 0
        self.unknown_scalars = 0

    # -- helpers
    def _cpu_args(self, flat):
        """The op's arguments with meta tensors replaced by their shadows, or None."""
        out = []
        for a in flat:
            if _is_meta(a):
                s = self.shadow.get(a)
                if s is None:
                    return None
                out.append(s)
            elif isinstance(a, torch.device) and a.type == "meta":
                out.append(torch.device("cpu"))
            else:
                out.append(a)
        return out

    def _small(self, t: torch.Tensor) -> bool:
        return t.numel() <= (self.max_numel >> 4 if t.is_floating_point() else self.max_numel)

    def _record(self, meta_out, cpu_out) -> None:
        metas, _ = tree_flatten(meta_out)
        cpus, _ = tree_flatten(cpu_out)
        for m, c in zip(metas, cpus):
            if _is_meta(m) and isinstance(c, torch.Tensor) and self._small(c):
                self.shadow[m] = c

    def _note_size(self, out, flat_in) -> None:
        """Largest storage an op allocates (views and in-place results of its inputs excluded)."""
        inputs = {a.untyped_storage()._cdata for a in flat_in if _is_meta(a)}
        for t in tree_flatten(out)[0]:
            if _is_meta(t) and t.untyped_storage()._cdata not in inputs:
                self.largest_bytes = max(self.largest_bytes, t.untyped_storage().nbytes())

    def _bool_to_int_indices(self, args):
        """index / index_put with boolean indices (shadowed) -> integer indices on meta."""
        x, indices, *rest = args
        new = []
        for ix in indices:
            if _is_meta(ix) and ix.dtype == torch.bool and self.shadow.get(ix) is not None:
                for col in self.shadow[ix].nonzero().unbind(1):
                    m = col.to("meta")
                    self.shadow[m] = col
                    new.append(m)
            else:
                new.append(ix)
        return (x, new, *rest)

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _is_meta(args[0]):
            s = self.shadow.get(args[0])
            if s is not None:
                return s.item()
            self.unknown_scalars += 1
            return False if args[0].dtype == torch.bool else 0 if not args[0].is_floating_point() else 0.0
        if func in _INDEX_OPS and any(_is_meta(i) and i.dtype == torch.bool for i in args[1] if i is not None):
            args = self._bool_to_int_indices(args)
        flat, spec = tree_flatten((args, kwargs))
        touches_meta = any(_is_meta(a) or (isinstance(a, torch.device) and a.type == "meta") for a in flat)
        if not touches_meta:
            return func(*args, **kwargs)
        cpu_flat = None if func in _NO_VALUES else self._cpu_args(flat)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            if cpu_flat is None:
                raise
            cpu_args, cpu_kwargs = tree_unflatten(cpu_flat, spec)
            cpu_out = func(*cpu_args, **cpu_kwargs)
            out = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, cpu_out)
            self._record(out, cpu_out)
            self._note_size(out, flat)
            return out
        self._note_size(out, flat)
        if cpu_flat is not None and all(self._small(t) for t in tree_flatten(out)[0] if _is_meta(t)):
            cpu_args, cpu_kwargs = tree_unflatten(cpu_flat, spec)
            self._record(out, func(*cpu_args, **cpu_kwargs))
        return out


class SavedBytes:
    """Bytes of the unique storages autograd saves for backward (a
    saved_tensors_hooks context), excluding the storages of `exclude`
    (parameters and batch inputs). Views count their whole storage once."""

    def __init__(self, exclude=()):
        self._skip = {self._key(t) for t in exclude}
        self._seen: dict = {}
        self._keep: list = []  # holds the storages so that their ids stay unique
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _pack(self, t):
        if isinstance(t, torch.Tensor):
            k = self._key(t)
            if k not in self._skip and k not in self._seen:
                self._seen[k] = t.untyped_storage().nbytes()
                self._keep.append(t)
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _efficient_sdpa(sdpa):
    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not query.is_meta:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        if key.shape[-3] != query.shape[-3]:  # GQA: the memory-efficient kernel wants one K/V head per query head
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        bias = None
        if attn_mask is not None:
            bias = attn_mask.to(query.dtype) if attn_mask.is_floating_point() else \
                torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~attn_mask, float("-inf"))
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]

    return call


@contextlib.contextmanager
def fused_attention():
    """SDPA on meta tensors through the memory-efficient kernel's meta implementation (see the module docstring)."""
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _efficient_sdpa(sdpa)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def measure(fn, exclude=()) -> dict:
    """Run `loss = fn()` and `loss.backward()` on meta tensors under MetaShadow,
    fused attention and a flop counter: FLOPs (forward, forward + backward),
    bytes saved for backward (`SavedBytes`, `exclude`d storages left out) and
    the largest tensor allocated; `out` is fn's return value."""
    from torch.utils.flop_counter import FlopCounterMode

    shadow = MetaShadow()
    with fused_attention(), shadow, FlopCounterMode(display=False) as fc:
        with SavedBytes(exclude=exclude) as saved:
            out = fn()
        forward = fc.get_total_flops()
        (out[0] if isinstance(out, tuple) else out).backward()
    return {"flops_forward": int(forward), "flops": int(fc.get_total_flops()), "saved_bytes": int(saved.total),
            "largest_tensor_bytes": int(shadow.largest_bytes), "unknown_scalars": shadow.unknown_scalars, "out": out}


# --------------------------------------------------------------------------- a drafter's training step on meta


def synthetic_batch(micro_batch: int, length: int, prompt: int, vocab: int, n_features: int, hidden: int,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """One micro-batch of `length` tokens, the last `length - prompt` of them
    assistant tokens: ids, masks on CPU (their values steer anchor sampling),
    cached features / final hidden states on meta (their values never matter)."""
    ids = (torch.arange(micro_batch * length) % max(1, vocab - 1)).view(micro_batch, length)
    loss_mask = torch.zeros(micro_batch, length, dtype=torch.bool)
    loss_mask[:, min(prompt, length - 2):] = True
    return {
        "input_ids": ids, "loss_mask": loss_mask,
        "attention_mask": torch.ones(micro_batch, length, dtype=torch.bool),
        "features": torch.empty(micro_batch, length, n_features * hidden, device="meta", dtype=dtype),
        "last_hidden": torch.empty(micro_batch, length, hidden, device="meta", dtype=dtype),
        "target_lse": torch.empty(micro_batch, length, device="meta", dtype=torch.float32),
    }


def measure_step(drafter, target: Target, batch: dict, spec, seed: int = 0) -> dict:
    """FLOPs (forward, forward+backward) and activation bytes of one real training
    step (`drafter.training_step` + backward) on meta (see the module docstring)."""
    exclude = [*drafter.parameters(), *target.model.parameters(), batch["features"], batch["last_hidden"],
               batch["target_lse"]]
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    r = measure(lambda: drafter.training_step(batch, spec, gen, log_step=False), exclude)
    drafter.zero_grad(set_to_none=True)
    metrics = r.pop("out")[1]
    r["positions"] = float(metrics.get("n_positions", metrics.get("n_anchors", 0.0) * getattr(drafter, "gamma", 1)))
    r["peak_activation_bytes"] = r["saved_bytes"] + r["largest_tensor_bytes"]
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def measure_target_forward(target: Target, batch: dict, layers, lse: bool = False) -> int:
    """FLOPs of the target forward that online mode runs per micro-batch (features + final
    hidden state, and with `lse` the LM head's log-normalizers, `Target.log_normalizer`)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = batch["input_ids"].to("meta")
    with fused_attention(), MetaShadow() as shadow:
        shadow.shadow[ids] = batch["input_ids"]
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            _, last = target.features(ids, layers, attention_mask=None)
            if lse:
                target.log_normalizer(last)
    return int(fc.get_total_flops())


def build_meta_drafter(method: str, target: Target, cfg: Settings | Mapping):
    """`build_drafter` on the meta device, in bf16 (as autocast computes), and the
    method's settings (`methods.method_settings`)."""
    from .. import drafters
    from ..methods import method_settings

    base, ms = method_settings(cfg, method)
    with torch.device("meta"):
        return drafters.build_drafter(base, target, ms).to(torch.bfloat16), ms


def param_counts(drafter, target: Target) -> dict:
    own = {id(p): p for p in drafter.parameters()}
    shared = {id(p): p for m in (target.embed_tokens, target.lm_head) for p in m.parameters()}
    return {
        "trainable": sum(p.numel() for p in own.values() if p.requires_grad),
        "frozen_own": sum(p.numel() for p in own.values() if not p.requires_grad),
        "frozen_shared_target": sum(p.numel() for k, p in shared.items() if k not in own),
    }

"""The target's KV cache for R ragged requests, and the attention that reads it
(deepspec/core/engine.py runs a round through it; the drafters group their
batched calls with `row_groups`).

`BatchKV` pads: the target's transformers DynamicCache holds [R, H, L, hd] per
layer with a validity mask [R, L]. A round's chunk is left-aligned per row
(anchor, drafts, then padding), so after verification a row keeps the first
1 + accepted slots of the chunk; the rest is masked and zeroed, and the cache is
cropped to the longest kept prefix. The cache is compacted when over a quarter
of its slots are needed by no row (left padding, which no compaction can remove,
does not count). Every query attends to exactly its request's verified tokens
(2-D attention mask), with RoPE positions = the request's verified length
(explicit position_ids).

What the padding would otherwise cost is avoided where it is cheap:
`InPlaceLayer` writes new keys/values into spare capacity instead of
concatenating; a joining request takes a left row in place (`BatchKV.put_many`);
rows attend in groups over only the keys each group needs (`row_groups`,
`_ragged_sdpa`); on CPU torch's sdpa groups the query heads itself
(`grouped_query_sdpa`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Optional, Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .target import Target, cache_kwarg, lm_head_in_chunks, prepacked_linears, select_features

COMPACT_FRACTION = 0.25  # compact when slots no row needs exceed this share of the cache


@contextlib.contextmanager
def grouped_query_sdpa(on: bool):
    """transformers' sdpa attention copies K/V once per query head (repeat_kv)
    whenever there is an attention mask, unless TRANSFORMERS_SDPA_FORCE_GQA=1
    lets torch's sdpa group the heads itself. On CPU that is exact and 1.8-2.6x
    faster for a masked batch forward (measured, SmolLM2-135M, 16 rows x 512
    tokens); on CUDA a masked GQA call falls back to the math kernel, so only CPU
    forwards set it, for the duration of the call."""
    key, old = "TRANSFORMERS_SDPA_FORCE_GQA", os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    if on:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if on:
            os.environ.pop(key) if old is None else os.environ.__setitem__(key, old)


def folded_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' `sdpa_attention_forward`, on CPU with the query heads of each K/V
    head folded into the query length: q [B, H, Lq, hd] -> [B, Hkv, G*Lq, hd] against
    k/v [B, Hkv, Lk, hd], the mask (shared by the heads) repeated G times along the
    queries. Every query row meets the same keys and mask as with `enable_gqa` or
    `repeat_kv`, so the output is the same (bit for bit on torch 2.13's CPU kernel,
    tests/test_engine.py), while torch's CPU flash kernel runs G times fewer,
    G times longer (batch, head) tiles: 1.2-1.45x faster for a round's 8 queries
    against 128-2,400 keys in bf16 (SmolLM2, G = 3), and no K/V copy where transformers
    would repeat them (a masked multi-token call without TRANSFORMERS_SDPA_FORCE_GQA).
    Elsewhere it is `sdpa_attention_forward` itself: one query (transformers packs
    those the same way unless TRANSFORMERS_SDPA_FORCE_GQA is set), training (the
    attention is ~3 % of a step), CUDA, no GQA, a per-head or absent causal mask,
    dropout, softcap, position bias."""
    G = getattr(module, "num_key_value_groups", 1)
    B, H, Lq, hd = query.shape
    causal_unmasked = attention_mask is None and Lq > 1 and kwargs.get("is_causal") is not False
    if (G == 1 or Lq == 1 or query.device.type != "cpu" or (torch.is_grad_enabled() and query.requires_grad) or causal_unmasked
            or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q = query.reshape(B, H // G, G * Lq, hd)
    mask = None
    if attention_mask is not None:
        m = attention_mask
        mask = m[:, :, None].expand(m.shape[0], 1, G, Lq, m.shape[-1]).reshape(m.shape[0], 1, G * Lq, m.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, Lq, value.shape[-1]).transpose(1, 2).contiguous(), None


RAGGED_ATTENTION = "deepspec_ragged_sdpa"
GROUP_OVERHEAD = 256  # one more attention call per layer, in (row x key) units of attention work
# The drafters' (drafters/dflash.py, eagle3.py): a separate block pass per group costs about
# as much as attending over this many more (request x context position) pairs (2 layers on
# SmolLM2's width, CPU).
DRAFT_GROUP_OVERHEAD = 1024
_ROW_GROUPS: contextvars.ContextVar = contextvars.ContextVar("deepspec_row_groups", default=None)


def row_groups(need: torch.Tensor, overhead: Optional[int] = None) -> list:
    """Partition the rows of a padded batch into groups that attend separately,
    each over the last max(need) keys of its rows: need[r] = how many trailing
    key slots row r needs (its oldest verified token onward). Rows sorted by need,
    contiguous groups chosen by dynamic programming to minimise
    sum_g |g| * max need_g + overhead * #groups (exact partition of a sorted list).
    Returns [(row index tensor, keys from the end)] - one group without ragged lengths."""
    overhead = GROUP_OVERHEAD if overhead is None else overhead
    order = torch.argsort(need, stable=True).tolist()
    n = [int(need[i]) for i in order]
    R = len(n)
    best, cut = [0] + [None] * R, [0] * (R + 1)
    for j in range(1, R + 1):  # best cost of the first j sorted rows
        best[j], cut[j] = min((best[i] + (j - i) * n[j - 1] + overhead, i) for i in range(j))
    groups, j = [], R
    while j > 0:
        i = cut[j]
        groups.append((torch.tensor(order[i:j], device=need.device), n[j - 1]))
        j = i
    return groups[::-1]


def _ragged_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, once per row group of `_ROW_GROUPS` over only the
    keys that group needs (masked padding columns dropped): a padded batch with one
    long prompt otherwise makes every row attend over the longest context. Exact:
    the dropped columns are masked for every row of the group."""
    groups = _ROW_GROUPS.get()
    if groups is None or len(groups) == 1:
        return folded_gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
    L, outs, rows = key.shape[2], [], []
    for idx, keep in groups:
        mask = None if attention_mask is None else attention_mask[idx][..., L - keep :]
        out, _ = folded_gqa_sdpa(module, query[idx], key[idx, :, L - keep :], value[idx, :, L - keep :], mask, **kwargs)
        outs.append(out)
        rows.append(idx)
    out = torch.empty((query.shape[0], *outs[0].shape[1:]), dtype=outs[0].dtype, device=outs[0].device)
    out[torch.cat(rows)] = torch.cat(outs)
    return out, None


AttentionInterface.register(RAGGED_ATTENTION, _ragged_sdpa)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def _ragged_attention(model, groups):
    """Run `model`'s sdpa attention through `_ragged_sdpa` with these row groups."""
    config = model.config
    old = config._attn_implementation
    if old != "sdpa" or groups is None:
        yield
        return
    token = _ROW_GROUPS.set(groups)
    config._attn_implementation = RAGGED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = old
        _ROW_GROUPS.reset(token)


class InPlaceLayer(DynamicLayer):
    """transformers' DynamicLayer.update concatenates, copying the whole cache at
    every forward: 60 copies of [R, H, L, hd] per batched SmolLM2 round, 7-18 % of
    the engine's target forward (measured). This layer keeps keys/values as views
    buf[:R, :, s:s+n] of buffers with spare rows, spare slots on the right (new
    positions are written in place) and, after `pad_left`, on the left (a longer
    joining prompt grows the cache without moving it). Whatever replaces
    keys/values with a tensor that is not such a view (cat, gather, batch
    selection do not give one; crop and BatchKV's row operations do) is copied
    into a fresh buffer at the next update, so every DynamicCache operation stays
    valid."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        s = _window_start(self.keys, getattr(self, "_kbuf", None), key_states, n + m)
        if s is None or s != _window_start(self.values, getattr(self, "_vbuf", None), value_states, n + m):
            self._adopt(n + m + _room(n + m), 0, n, key_states, value_states)
            s = 0
        R = key_states.shape[0]
        self._kbuf[:R, :, s + n : s + n + m] = key_states
        self._vbuf[:R, :, s + n : s + n + m] = value_states
        self.keys, self.values = self._kbuf[:R, :, s : s + n + m], self._vbuf[:R, :, s : s + n + m]
        return self.keys, self.values

    def _adopt(self, cap: int, left: int, n: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Copy the n current slots into fresh buffers of `cap` slots (rows and heads
        shaped like `like_*`), starting at `left`."""
        def grown(old, like):
            buf = like.new_empty(like.shape[0], like.shape[1], cap, like.shape[3])
            if n:
                buf[:, :, left : left + n] = old
            return buf

        self._kbuf, self._vbuf = grown(self.keys, like_k), grown(self.values, like_v)
        self.keys, self.values = self._kbuf[:, :, left : left + n], self._vbuf[:, :, left : left + n]

    def pad_left(self, d: int) -> None:
        """d zero slots before every row's slots; in place when the buffers have room on the left."""
        n = self.keys.shape[-2]
        s = _window_start(self.keys, getattr(self, "_kbuf", None), self.keys, n)
        if s is None or s < d or s != _window_start(self.values, getattr(self, "_vbuf", None), self.values, n):
            s = d + _room(n + d)  # room to grow on both sides
            self._adopt(s + n + _room(n + d), s, n, self.keys, self.values)
        R = self.keys.shape[0]
        for buf in (self._kbuf, self._vbuf):
            buf[:R, :, s - d : s] = 0
        self.keys, self.values = self._kbuf[:R, :, s - d : s + n], self._vbuf[:R, :, s - d : s + n]

    def gather_slots(self, order: torch.Tensor) -> None:
        """Row r keeps slots order[r] ([R, T]), gathered straight into fresh buffers
        with room on the right (a plain gather would be copied again at the next update)."""
        R, T = order.shape
        cap = T + _room(T)
        for name in ("keys", "values"):
            t = getattr(self, name)
            buf = t.new_empty(R, t.shape[1], cap, t.shape[3])
            torch.gather(t, 2, order[:, None, :, None].expand(R, t.shape[1], T, t.shape[3]), out=buf[:, :, :T])
            setattr(self, "_kbuf" if name == "keys" else "_vbuf", buf)
            setattr(self, name, buf[:, :, :T])


def _room(n: int) -> int:
    """Spare slots a buffer of n slots gets on a side it grows on: growth is amortised
    (a copy per many rounds) without doubling a long prompt's padded batch."""
    return max(64, min(n // 2, 512))


def row_slots(tokens: int, width: int) -> int:
    """Most cache slots one row of a `BatchKV` takes for a request of `tokens`
    positions (prompt + max_new_tokens) verified `width` at a time: its verified
    tokens, the last round's overshoot and the next chunk (2 * width), the slots no
    row needs that are left before a compaction (at most COMPACT_FRACTION of the
    cache), and the spare room of the buffers on both sides (`_room`)."""
    slots = math.ceil((tokens + 2 * width) / (1 - COMPACT_FRACTION))
    return slots + 2 * _room(slots)


def cache_bytes_per_token(cache, n: int) -> float:
    """Bytes per position of a one-row cache holding n positions: the keys and
    values of every layer as stored (per-layer head widths and K/V heads included,
    as Gemma4's full-attention layers have them)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / n


def _window_start(t: torch.Tensor, buf: Optional[torch.Tensor], new: torch.Tensor, need: int) -> Optional[int]:
    """s when t is buf[:R, :, s:s+n] with R rows shaped like `new` and room up to s + `need`, else None."""
    if buf is None or t.dim() != 4 or t.stride() != buf.stride() or t.shape[0] > buf.shape[0]:
        return None
    if t.shape[0] != new.shape[0] or buf.shape[1] != new.shape[1] or buf.shape[3] != new.shape[3]:
        return None
    off = t.data_ptr() - buf.data_ptr()
    step = buf.stride(2) * buf.element_size()
    if off < 0 or off % step or off // step + need > buf.shape[2] or (off // step) * buf.stride(2) >= buf.stride(1):
        return None
    return off // step


def engine_cache() -> DynamicCache:
    """An empty DynamicCache whose layers are `InPlaceLayer`s."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = InPlaceLayer
    return cache


class BatchKV:
    """The target's KV cache for R rows: a DynamicCache [R, H, L, hd] per layer and
    a validity mask [R, L]; row r's verified tokens are its valid slots, in order."""

    def __init__(self, contiguous: bool = False):
        # contiguous: keep every row's verified tokens adjacent (compact after each round), for
        # sliding-window attention, which measures its window in cache slots, not positions
        self.cache, self.valid, self.contiguous = None, None, contiguous

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def _layers(self):
        return self.cache.layers

    def add(self, cache, n: int) -> None:
        """Append a request prefilled alone (its cache holds n positions)."""
        self.add_many([(cache, n)])

    def add_many(self, joining: Sequence[tuple]) -> None:
        """Append requests prefilled alone, (cache, n positions) each, left-padding
        every row to a common length: one copy of the cache per layer however many
        join (appending them one at a time would copy it once per request)."""
        valids = ([self.valid] if self.cache is not None else []) + [
            torch.ones(1, n, dtype=torch.bool, device=c.layers[0].keys.device) for c, n in joining]
        parts = ([self.cache] if self.cache is not None else []) + [c for c, _ in joining]
        T = max(v.shape[1] for v in valids)
        if self.cache is None:
            self.cache = joining[0][0]
        for i, layer in enumerate(self._layers()):
            for name in ("keys", "values"):
                ts = [getattr(c.layers[i], name) for c in parts]
                out = ts[0].new_zeros(sum(t.shape[0] for t in ts), ts[0].shape[1], T, ts[0].shape[3])
                row = 0
                for t in ts:
                    out[row : row + t.shape[0], :, T - t.shape[2] :] = t
                    row += t.shape[0]
                setattr(layer, name, out)
        self.valid = torch.cat([torch.nn.functional.pad(v, (T - v.shape[1], 0)) for v in valids])

    def put_many(self, placing: Sequence[tuple]) -> None:
        """Put requests prefilled alone, (row, cache, n positions) each, into rows whose
        requests left: each row's slots are overwritten in place (right-aligned,
        left part masked and zeroed), so the other rows are not copied unless a
        prompt is longer than the cache (then the cache grows on the left once)."""
        T = max(n for _, _, n in placing)
        if T > self.length:
            self._pad_left(T - self.length)
        L = self.length
        for i, layer in enumerate(self._layers()):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                for row, cache, n in placing:
                    t[row, :, : L - n] = 0
                    t[row, :, L - n :] = getattr(cache.layers[i], name)[0]
        for row, _, n in placing:
            self.valid[row] = torch.arange(L, device=self.valid.device) >= L - n
        self._maybe_compact()

    def _pad_left(self, d: int) -> None:
        for layer in self._layers():
            if isinstance(layer, InPlaceLayer):
                layer.pad_left(d)  # in place when its buffers have room on the left
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                out = t.new_zeros(t.shape[0], t.shape[1], t.shape[2] + d, t.shape[3])
                out[:, :, d:] = t
                setattr(layer, name, out)
        self.valid = torch.nn.functional.pad(self.valid, (d, 0))

    def remove(self, leaving: Sequence[int]) -> list[int]:
        """Drop these rows (their requests left, none is queued): the last kept rows
        move into the lowest free rows and the batch is cut to the kept rows, a view
        (one row copied per leaving request, not the whole cache). Returns the old
        row of each new row (the caller reorders its rows the same way)."""
        gone = set(leaving)
        keep = [i for i in range(self.valid.shape[0]) if i not in gone]
        if not keep:
            self.cache, self.valid = None, None
            return []
        R = len(keep)
        moves = list(zip(sorted(i for i in gone if i < R), [i for i in keep if i >= R]))  # (free row, moved row)
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                for dst, src in moves:
                    t[dst] = t[src]
            layer.keys, layer.values = layer.keys[:R], layer.values[:R]  # views: InPlaceLayer keeps its buffers
        for dst, src in moves:
            self.valid[dst] = self.valid[src]
        self.valid = self.valid[:R]
        order = list(range(R))
        for dst, src in moves:
            order[dst] = src
        self._maybe_compact()
        return order

    def commit(self, start: int, kept: torch.Tensor) -> None:
        """After a round whose chunk began at `start`: row r keeps its first kept[r]
        chunk slots (anchor + accepted drafts); the others are masked and zeroed."""
        new_len = start + int(kept.max())
        keep = torch.arange(new_len - start, device=kept.device)[None] < kept[:, None]  # [R, W']
        for layer in self._layers():
            for name in ("keys", "values"):
                t = getattr(layer, name)[:, :, :new_len]
                t[:, :, start:] *= keep[:, None, :, None].to(t.dtype)
                setattr(layer, name, t)
        self.valid = torch.cat([self.valid[:, :start], keep], 1)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if self.contiguous or self.length - int(self.valid.sum(1).max()) > COMPACT_FRACTION * self.length:
            self.compact(force=self.contiguous)

    def compact(self, force: bool = False) -> None:
        """Move each row's valid slots to the right end (order kept), dropping slots
        no row needs; without `force` only when some slot is needed by no row."""
        counts = self.valid.sum(1)
        T, L = int(counts.max()), self.length
        if T == L and not force:
            return
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, L - T :]  # [R, T]: masked first
        self.valid = self.valid.gather(1, order)
        for layer in self._layers():
            if isinstance(layer, InPlaceLayer):
                layer.gather_slots(order)
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, t.gather(2, order[:, None, :, None].expand(t.shape[0], t.shape[1], T, t.shape[3])))

    def forward(self, target: Target, ids: torch.Tensor, widths: torch.Tensor, layers):
        """Target forward of chunk ids [R, W] (row r's first widths[r] are real) after
        each row's verified tokens. Returns (logits [R, W, V], features or None)."""
        W = ids.shape[1]
        chunk = torch.arange(W, device=ids.device)[None] < widths[:, None]
        pos = self.valid.sum(1, keepdim=True) + torch.arange(W, device=ids.device)[None]
        groups = None if self.contiguous else row_groups(self.length + W - self.valid.int().argmax(1))
        with grouped_query_sdpa(ids.device.type == "cpu"), _ragged_attention(target.model, groups), \
                prepacked_linears(target), lm_head_in_chunks(target):
            out = target.model(input_ids=ids, attention_mask=torch.cat([self.valid, chunk], 1).long(), position_ids=pos,
                               use_cache=True, output_hidden_states=layers is not None,
                               **{cache_kwarg(target.model): self.cache})
        return out.logits, (None if layers is None else select_features(out.hidden_states, layers))


def has_sliding_window(target: Target) -> bool:
    """Whether some layer of the target attends through a sliding window (Gemma, Mistral, Qwen with it on)."""
    c = target.text_config
    if any(t != "full_attention" for t in (getattr(c, "layer_types", None) or [])):
        return True
    return bool(getattr(c, "sliding_window", None)) and getattr(c, "use_sliding_window", True) is not False

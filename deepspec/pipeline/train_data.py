"""The train rule's data: datasets over the target cache
(`deepspec.pipeline.cache`), or over the same features computed from the
target on the fly (``cache.mode: online``), and their batches.

Both yield identical samples for the same data: ``input_ids`` long [L],
``loss_mask`` bool [L], ``features`` float32 [L, m*d] (the feature layers,
rounded through the cache dtype) and ``last_hidden`` float32 [L, d];
`collate` pads them into a batch (docs/INTERFACES.md).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import DeepSpecError
from ..paths import RunPaths
from ..files import sha256_file
from .cache import DTYPES, compute_rows, data_fingerprint, forward_plan, validate_cache
from .conversations import TokenizedSample, tokenized_samples


def _sample_dict(ids, mask, feats, last) -> dict:
    return {
        "input_ids": torch.as_tensor(ids).long(),
        "loss_mask": torch.as_tensor(mask).bool(),
        "features": feats.float(),
        "last_hidden": last.float(),
    }


class CacheDataset(torch.utils.data.Dataset):
    """Samples read from a built cache (memory-mapped slices of the shards).
    Each process checks a shard's sha256 against the manifest the first time
    it opens it: a damaged shard stops training with one line."""

    def __init__(self, cache_dir: str | os.PathLike, manifest: Optional[dict] = None):
        from safetensors import safe_open

        self.dir = Path(cache_dir)
        self.manifest = manifest or validate_cache(self.dir, checksums=False)
        self.fingerprint = self.manifest["fingerprint"]  # the data's, same as OnlineDataset's
        self._index: list[tuple[int, int, int]] = []  # (shard, row start, row end)
        self.ids: list[str] = []
        for k, sh in enumerate(self.manifest["shards"]):
            with safe_open(str(self.dir / sh["file"]), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
                self.ids += json.loads(f.metadata()["deepspec"])["ids"]
            self._index += [(k, a, b) for a, b in zip(off[:-1], off[1:])]
        self._handles: dict = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._index)

    def _open(self, k: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # a DataLoader worker: do not share file handles
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            shard = self.manifest["shards"][k]
            if sha256_file(self.dir / shard["file"]) != shard["sha256"]:
                raise DeepSpecError(f"shard {self.dir / shard['file']} is corrupt: sha256 mismatch (rebuild it: build-cache)")
            self._handles[k] = safe_open(str(self.dir / shard["file"]), framework="pt")
        return self._handles[k]

    def __getitem__(self, i: int) -> dict:
        k, a, b = self._index[i]
        f = self._open(k)
        return _sample_dict(*(f.get_slice(n)[a:b] for n in ("input_ids", "loss_mask", "features", "last_hidden")))


class OnlineDataset(torch.utils.data.Dataset):
    """The same samples as `CacheDataset`, computed from the target on demand.

    Sample i is computed in its cache forward batch (`forward_plan`) and rounded
    through cache.dtype, so it is bit-identical to the cached one. Computed
    batches are kept (in cache.dtype) up to `memo_bytes`, least recently used
    first out: a small training set is computed once per run whatever the
    read order; beyond that, reading in `forward_order()` costs one forward
    per batch and arbitrary order up to one batch forward per sample.
    """

    def __init__(self, cfg: dict, target, samples: Sequence[TokenizedSample], memo_bytes: int = 1 << 30):
        self.target, self.samples = target, list(samples)
        self.layers = list(cfg["target"]["feature_layers"])
        self.dtype = DTYPES[cfg["cache"]["dtype"]]
        self.ids = [s.id for s in self.samples]
        self.fingerprint = data_fingerprint(cfg, target.target_id, self.samples)  # the data's, same as the cache's
        self.batches = forward_plan([len(s.input_ids) for s in self.samples], cfg)
        self._batch_of = {j: b for b, batch in enumerate(self.batches) for j in batch}
        self._memo: OrderedDict[int, dict] = OrderedDict()
        self._memo_bytes, self._budget = 0, memo_bytes

    def __len__(self) -> int:
        return len(self.samples)

    def forward_order(self) -> list[int]:
        """Sample indices grouped by forward batch (efficient iteration order)."""
        return [j for batch in self.batches for j in batch]

    @staticmethod
    def _nbytes(rows: dict) -> int:
        return sum(f.nbytes + h.nbytes for f, h in rows.values())

    def __getitem__(self, i: int) -> dict:
        b = self._batch_of[i]
        if b not in self._memo:
            batch = self.batches[b]
            rows = dict(zip(batch, compute_rows(self.target, self.layers, [self.samples[j] for j in batch], self.dtype)))
            self._memo[b] = rows
            self._memo_bytes += self._nbytes(rows)
            while self._memo_bytes > self._budget and len(self._memo) > 1:
                self._memo_bytes -= self._nbytes(self._memo.popitem(last=False)[1])
        self._memo.move_to_end(b)
        s = self.samples[i]
        feats, last = self._memo[b][i]
        return _sample_dict(s.input_ids, s.loss_mask, feats, last)


def make_train_dataset(
    cfg: dict,
    target=None,
    *,
    cache_dir: Optional[str | os.PathLike] = None,
    conversations: Optional[str | os.PathLike] = None,
) -> torch.utils.data.Dataset:
    """The training Dataset for cfg.cache.mode: the built cache ('offline') or
    features computed from the target on the fly ('online'); same samples."""
    t, c = cfg["target"], cfg["cache"]
    if c["mode"] == "online":
        if target is None:
            from .target import target_from_config

            target = target_from_config(cfg)
        samples, _ = tokenized_samples(cfg, target.tokenizer, conversations or RunPaths.of(cfg).conversations())
        return OnlineDataset(cfg, target, samples)
    d = Path(cache_dir) if cache_dir else RunPaths.of(cfg).cache_dir()
    m = validate_cache(d, checksums=False)
    want = {"feature_layers": list(t["feature_layers"]), "dtype": c["dtype"], "target_name": t["name"]}
    for k, v in want.items():
        if m.get(k) != v:
            raise DeepSpecError(f"target cache {d} has {k}={m.get(k)!r} but the preset wants {v!r}: rebuild it (build-cache)")
    return CacheDataset(d, m)


def collate(samples: Sequence[dict]) -> dict:
    """Right-pad samples to [N, Lmax] (zeros / False) and add attention_mask bool [N, Lmax]."""
    if not samples:
        raise ValueError("collate: empty batch")
    N, L = len(samples), max(s["input_ids"].shape[0] for s in samples)
    out = {"attention_mask": torch.zeros((N, L), dtype=torch.bool)}
    for k in ("input_ids", "loss_mask", "features", "last_hidden"):
        first = samples[0][k]
        out[k] = torch.zeros((N, L, *first.shape[1:]), dtype=first.dtype)
        for r, s in enumerate(samples):
            out[k][r, : s[k].shape[0]] = s[k]
    for r, s in enumerate(samples):
        out["attention_mask"][r, : s["input_ids"].shape[0]] = True
    return out


def token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """Assistant-token counts [V] over the training set, which choose a reduced
    draft vocabulary (drafter.draft_vocab_size). Uses the dataset's tokenized
    `samples` when it has them (online mode: no target forward), else one pass
    over the samples."""
    from ..drafters import count_tokens

    if all(hasattr(s, "input_ids") and hasattr(s, "loss_mask") for s in getattr(dataset, "samples", [None])):
        pairs = [(s.input_ids, s.loss_mask) for s in dataset.samples]
    else:
        pairs = [(s["input_ids"], s["loss_mask"]) for s in (dataset[i] for i in range(len(dataset)))]
    ids, masks = zip(*pairs)
    return count_tokens(ids, vocab_size, list(masks))

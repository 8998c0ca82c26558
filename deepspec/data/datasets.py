"""The train rule's data: datasets over the target cache
(`deepspec.data.cache`), or over the same features computed from the
target on the fly (``cache.mode: online``), and their batches.

The cache's samples are ``input_ids`` long [L], ``loss_mask`` bool [L],
``features`` float32 [L, m*d] (the feature layers, rounded through the cache
dtype), ``last_hidden`` float32 [L, d] and, with a reduced draft vocabulary,
``target_lse`` float32 [L] (the target's log-normalizers); `collate` pads them into a batch
(docs/INTERFACES.md). Online samples are the tokens alone, and their collate
function, `OnlineFeatures`, adds the same features from one target forward
per micro batch on the training device (`train_collate` picks it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..errors import DeepSpecError
from ..files import sha256_file
from ..paths import RunPaths
from ..settings import Settings
from .cache import (
    DTYPES,
    cache_target,
    data_fingerprint,
    forward_features,
    has_log_normalizers,
    stores_log_normalizers,
    validate_cache,
)
from .conversations import TokenArrays, tokenized_samples


def _sample_dict(ids, mask, feats, last, lse=None) -> dict:
    out = {
        "input_ids": torch.as_tensor(ids).long(),
        "loss_mask": torch.as_tensor(mask).bool(),
        "features": feats.float(),
        "last_hidden": last.float(),
    }
    if lse is not None:
        out["target_lse"] = lse.float()
    return out


class CacheDataset(torch.utils.data.Dataset):
    """Samples read from a built cache (memory-mapped slices of the shards).
    Each process checks a shard's sha256 against the manifest the first time
    it opens it: a damaged shard stops training with one line."""

    def __init__(self, cache_dir: str | os.PathLike, manifest: Optional[dict] = None):
        from safetensors import safe_open

        self.dir = Path(cache_dir)
        self.manifest = manifest or validate_cache(self.dir, checksums=False)
        self.fingerprint = self.manifest["fingerprint"]  # the data's, same as OnlineDataset's
        self.names = ("input_ids", "loss_mask", "features", "last_hidden",
                      *(("target_lse",) if has_log_normalizers(self.manifest) else ()))  # as the cache has them
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
        return _sample_dict(*(f.get_slice(n)[a:b] for n in self.names))


class OnlineDataset(torch.utils.data.Dataset):
    """The tokens of the same samples as `CacheDataset`, without features: in
    online mode the features come from the target, one forward per training
    micro batch, computed by `OnlineFeatures` (the collate function)."""

    def __init__(self, s: Settings, target, samples: TokenArrays):
        self.samples = samples  # memory-mapped, shared by the processes of a machine
        self.ids = list(samples.sample_ids)
        self.features = OnlineFeatures(s, target)
        # At micro batch 1 the features equal those of a cache built at
        # cache.batch_size 1, and so does the fingerprint; else the forward
        # batches are the micro batches (their composition is in the train settings).
        # (data_fingerprint reads config paths, config.CACHE_BYTES_SETTINGS: the config with that batch size)
        micro = s.train.micro_batch
        same_as = {**s.raw, "cache": {**s.raw["cache"], "batch_size": 1 if micro == 1 else f"online micro_batch {micro}"}}
        self.fingerprint = data_fingerprint(same_as, target.target_id, self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        return {"input_ids": torch.from_numpy(np.array(s.input_ids, dtype=np.int64)),
                "loss_mask": torch.from_numpy(np.array(s.loss_mask, dtype=bool))}


class OnlineFeatures:
    """The online-mode collate function: pads a micro batch's token samples
    (`collate`) and adds its features from ONE target forward over exactly those
    sequences, on the target's (the training) device, rounded through
    cache.dtype and then float32 there (as `CacheDataset` reads the cache);
    padded positions are zero. Counts the forwards it ran (`forwards`) and the
    real and padded tokens they covered (`tokens`, `padded_tokens`)."""

    def __init__(self, s: Settings, target):
        self.target = target
        self.layers = list(s.target.feature_layers)
        self.dtype = DTYPES[s.cache.dtype]
        self.lse = stores_log_normalizers(s)
        self.forwards = self.tokens = self.padded_tokens = 0

    def __call__(self, samples: Sequence[dict]) -> dict:
        batch = collate(samples)
        feats, last, lse = forward_features(self.target, self.layers, [s["input_ids"] for s in samples], self.dtype,
                                            self.lse)
        keep = batch["attention_mask"].to(feats.device)[..., None]
        batch["features"] = feats.float().masked_fill_(~keep, 0.0)
        batch["last_hidden"] = last.float().masked_fill_(~keep, 0.0)
        if lse is not None:
            batch["target_lse"] = lse.masked_fill_(~keep[..., 0], 0.0)
        self.forwards += 1
        self.tokens += int(batch["attention_mask"].sum())
        self.padded_tokens += batch["attention_mask"].numel()
        return batch

    def counters(self) -> dict:
        """What the summary reports (`train.run_from_config`)."""
        return {"online_target_forwards": self.forwards, "online_target_tokens": self.tokens,
                "online_target_padded_tokens": self.padded_tokens}


def make_train_dataset(
    cfg: Settings | Mapping,
    target=None,
    *,
    cache_dir: Optional[str | os.PathLike] = None,
    conversations: Optional[str | os.PathLike] = None,
) -> torch.utils.data.Dataset:
    """The training Dataset for cfg.cache.mode: the built cache ('offline') or
    features computed from the target on the fly ('online'); same samples."""
    s = Settings.view(cfg)
    t, c = s.target, s.cache
    if c.mode == "online":
        if target is None:
            from ..targets.loading import target_from_config

            target = target_from_config(s)
        paths = RunPaths.of(s)
        samples, _ = tokenized_samples(s.data, target.tokenizer, conversations or paths.conversations(),
                                       record=paths.tokens_record())
        return OnlineDataset(s, cache_target(s, target), samples)  # features as the offline cache computes them
    d = Path(cache_dir) if cache_dir else RunPaths.of(s).cache_dir()
    m = validate_cache(d, checksums=False)
    want = {"feature_layers": list(t.feature_layers), "dtype": c.dtype, "target_name": t.name}
    for k, v in want.items():
        if m.get(k) != v:
            raise DeepSpecError(f"target cache {d} has {k}={m.get(k)!r} but the preset wants {v!r}: rebuild it (build-cache)")
    return CacheDataset(d, m)


def train_collate(dataset) -> Callable[[Sequence[dict]], dict]:
    """The collate function of a training dataset: `OnlineFeatures` for online
    samples (the target forward), else `collate`."""
    return dataset.features if isinstance(dataset, OnlineDataset) else collate


def collate(samples: Sequence[dict]) -> dict:
    """Right-pad samples to [N, Lmax] (zeros / False) and add attention_mask bool
    [N, Lmax]; the keys of the first sample (online samples have no features).
    Padded positions are outside every loss and metric (their p_t is never read
    unmasked), so zero target_lse there is as good as any."""
    if not samples:
        raise ValueError("collate: empty batch")
    N, L = len(samples), max(s["input_ids"].shape[0] for s in samples)
    out = {"attention_mask": torch.zeros((N, L), dtype=torch.bool)}
    for k in [k for k in ("input_ids", "loss_mask", "features", "last_hidden", "target_lse") if k in samples[0]]:
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

    samples = getattr(dataset, "samples", None)
    if isinstance(samples, TokenArrays):  # the assistant tokens of the whole mapped array at once
        ids = torch.from_numpy(np.asarray(samples.input_ids)[np.asarray(samples.loss_mask)].astype(np.int64))
        return count_tokens([ids], vocab_size)
    pairs = [(s["input_ids"], s["loss_mask"]) for s in (dataset[i] for i in range(len(dataset)))]
    ids, masks = zip(*pairs)
    return count_tokens(ids, vocab_size, list(masks))

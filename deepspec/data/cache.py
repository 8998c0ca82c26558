"""The build_cache rule (workflow/rules/cache.smk): the target cache (paper §3,
"Target cache"); the training datasets over it are in
`deepspec.data.datasets`.

Per sample the drafters need: ``input_ids``, the assistant ``loss_mask``, the
concatenated outputs of the preset's feature layers (``features`` [L, m*d]) and
the final-norm hidden state (``last_hidden`` [L, d]); logits are never stored
(the frozen lm_head recomputes them). When the drafters draft from a reduced
vocabulary (drafter.draft_vocab_size), also the log-normalizer of the target's
logits at each position (``target_lse`` [L], `Target.log_normalizer` of the
stored ``last_hidden``): with it a row of p_t costs the K draft-vocabulary
columns of the LM head in training instead of all V.

On-disk format (``FORMAT`` version ``VERSION``), a directory holding
  * ``shard-NNNNN.safetensors``: the shard's samples concatenated along the
    token axis - ``input_ids`` int32 [T], ``loss_mask`` uint8 [T],
    ``features`` [T, m*d] and ``last_hidden`` [T, d] in cache.dtype,
    ``target_lse`` float32 [T] where the manifest says so (``target_lse``;
    a cache without it trains with p_t from all V logits), and
    ``offsets`` int64 [n+1] (sample j is rows offsets[j]:offsets[j+1]); the
    sample ids are in the safetensors metadata (key ``deepspec``);
  * ``manifest.json``, written last and atomically: format, version, target,
    layers, dtype, sizes, counts, bytes per token and per-shard sha256 and
    sample ranges. No manifest = no (finished) cache.

Determinism: samples are ordered by id; shard boundaries depend only on sample
lengths (a shard closes once it holds cache.shard_tokens tokens); inside a
shard, forward batches are the samples sorted by length, cache.batch_size at a
time (padded for the forward, stored unpadded). A forward's numbers depend on
the batch it ran in (padding changes the kernels' blocking). Online mode
(`deepspec.data.datasets.OnlineFeatures`) runs one forward per training
micro batch instead and rounds through the same dtype: at train.micro_batch 1
its features are bit-identical to a cache built at cache.batch_size 1 (and
share its fingerprint); otherwise they agree up to that rounding.

Resumability: each finished shard is written atomically and recorded with its
sha256 in ``progress.json``; a rerun with the same inputs keeps the shards
whose checksum still matches and redoes the rest, so a killed run ends
byte-identical to an uninterrupted one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from ..config import CACHE_BYTES_SETTINGS, pick
from ..errors import DeepSpecError
from ..files import atomic_path, human_bytes, read_json, sha256_file, write_json_atomic
from ..paths import RunPaths
from ..runtime import resolve_precision
from ..settings import Cache, Settings
from ..targets.specs import text_dims
from .conversations import TokenArrays, TokenizedSample, tokenized_samples

log = logging.getLogger(__name__)

FORMAT = "deepspec-target-cache"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


# ---------------------------------------------------------------- samples and plan


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Sample ranges [start, end): a shard closes once it holds >= shard_tokens tokens."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def plan_batches(lengths: Sequence[int], start: int, end: int, batch_size: int) -> list[list[int]]:
    """Forward batches of one shard: its samples sorted by decreasing length (then
    index) so that padding is small, batch_size at a time."""
    idx = sorted(range(start, end), key=lambda i: (-lengths[i], i))
    return [idx[k : k + batch_size] for k in range(0, len(idx), batch_size)]


def forward_plan(lengths: Sequence[int], cache: Cache) -> list[list[int]]:
    """All forward batches, shard by shard: the single source of truth for both modes."""
    return [b for s, e in plan_shards(lengths, cache.shard_tokens) for b in plan_batches(lengths, s, e, cache.batch_size)]


def stores_log_normalizers(cfg: Settings | Mapping) -> bool:
    """Whether the cache (and online mode) carries target_lse: the drafters draft
    from a reduced vocabulary, where it spares the LM head's other V - K columns."""
    return Settings.view(cfg).drafter.draft_vocab_size is not None


def forward_features(target, layers: Sequence[int], rows: Sequence, dtype: torch.dtype, lse: bool = False):
    """One right-padded target forward over `rows` (token id sequences), on the
    target's device: (features [N, Lmax, m*d], last_hidden [N, Lmax, d]) rounded
    to `dtype` and, with `lse`, the log-normalizer of the target's logits on that
    rounded last_hidden (float32 [N, Lmax]; else None), padded positions included
    (callers drop or zero them)."""
    L = max(len(r) for r in rows)
    pad = target.tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    am = torch.zeros((len(rows), L), dtype=torch.long)
    for r, x in enumerate(rows):
        ids[r, : len(x)] = x if torch.is_tensor(x) else torch.from_numpy(np.array(x, dtype=np.int64))
        am[r, : len(x)] = 1
    feats, last = target.features(ids, layers, attention_mask=am)  # no_grad
    last = last.to(dtype)
    return feats.to(dtype), last, target.log_normalizer(last) if lse else None


def compute_rows(target, layers: Sequence[int], samples: Sequence[TokenizedSample], dtype: torch.dtype,
                 lse: bool = False):
    """One padded forward; per sample {features [L, m*d], last_hidden [L, d]} rounded
    to `dtype` (and target_lse [L] float32 with `lse`), on the CPU."""
    out = dict(zip(("features", "last_hidden", "target_lse"),
                   forward_features(target, layers, [s.input_ids for s in samples], dtype, lse)))
    return [{k: x[r, : len(s.input_ids)].cpu() for k, x in out.items() if x is not None} for r, s in enumerate(samples)]


def data_fingerprint(cfg: Settings | Mapping, target_id: str, samples: TokenArrays) -> str:
    """Everything the cache's bytes depend on: the settings of config.CACHE_BYTES_SETTINGS
    (part of the build_cache rule's settings), the dtype the forward computes in
    on this machine (`cache_precision`; named only when it is not target.dtype,
    which caches were computed in before cache.precision existed, so those stay
    valid) and the exact token data (the digest of the token arrays)."""
    s = Settings.view(cfg)
    h = hashlib.sha256()
    settings = dict(version=VERSION, target_id=target_id,
                    **{name: pick(s, path) for name, path in CACHE_BYTES_SETTINGS.items()})
    compute = cache_precision(s)
    if compute != s.target.dtype:
        settings["compute_dtype"] = compute
    if stores_log_normalizers(s):  # named only when stored: caches without target_lse keep their fingerprints
        settings["target_lse"] = True
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(samples.digest.encode())
    return h.hexdigest()


def _read_state(path: Path) -> dict:
    """A progress file or an old manifest; missing or damaged reads as none."""
    try:
        return read_json(path, default={})
    except DeepSpecError:
        return {}


def bytes_per_token(n_layers: int, hidden: int, dtype: str, lse: bool = False) -> int:
    """int32 id + uint8 mask + (m*d + d) hidden values (+ float32 target_lse with `lse`;
    offsets are per sample, negligible)."""
    return 4 + 1 + (n_layers + 1) * hidden * DTYPES[dtype].itemsize + (4 if lse else 0)


def _hidden_size(cfg: Settings | Mapping, target=None) -> int:
    return target.hidden_size if target is not None else text_dims(cfg, download=True)["hidden_size"]


# ---------------------------------------------------------------- building


def _write_shard(path: Path, samples: Sequence[TokenizedSample], rows) -> None:
    from safetensors.torch import save_file

    lengths = [len(s.input_ids) for s in samples]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples])),
        "loss_mask": torch.from_numpy(np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in samples])),
        **{k: torch.cat([r[k] for r in rows]).contiguous() for k in rows[0]},  # features, last_hidden[, target_lse]
        "offsets": offsets,
    }
    # One metadata key: safetensors writes the metadata map in hash order, and
    # the bytes must not depend on it.
    meta = {"deepspec": json.dumps({"format": FORMAT, "version": VERSION, "ids": [s.id for s in samples]})}
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def build_cache(
    cfg: Settings | Mapping,
    conversations: Optional[str | os.PathLike] = None,
    out: Optional[str | os.PathLike] = None,
    *,
    target=None,
    dry_run: bool = False,
) -> dict:
    """Build (or finish) the target cache; returns the manifest (the estimate with dry_run)."""
    from ..targets.loading import load_tokenizer

    s = Settings.view(cfg)
    paths = RunPaths.of(s)
    conversations = Path(conversations) if conversations else paths.conversations()
    out = Path(out) if out else paths.cache_dir()
    samples, stats = tokenized_samples(s.data, target.tokenizer if target is not None else load_tokenizer(s), conversations,
                                       record=paths.tokens_record())
    lengths = samples.lengths()
    n_tokens, hidden = sum(lengths), _hidden_size(s, target)
    bpt = bytes_per_token(len(s.target.feature_layers), hidden, s.cache.dtype, stores_log_normalizers(s))
    estimate = {"samples": len(samples), "tokens": n_tokens, "bytes_per_token": bpt, "estimated_bytes": bpt * n_tokens}
    msg = (f"target cache estimate: {len(samples)} samples, {n_tokens} tokens x {bpt} bytes/token = "
           f"{human_bytes(bpt * n_tokens)} ({bpt * n_tokens} bytes)")
    if dry_run:
        print(msg)
        return estimate
    log.info(msg)

    target_id = target.target_id if target is not None else s.target.spec
    fp = data_fingerprint(s, target_id, samples)
    progress = _resume_state(out, fp)
    if progress is None:  # up to date
        return read_manifest(out)
    target = cache_target(s, target)
    t0 = time.perf_counter()
    shard_entries, written, new_tokens = _write_shards(s, target, samples, out, progress)
    secs = time.perf_counter() - t0
    manifest = _manifest(s, target_id, samples, stats, hidden, fp, shard_entries,
                         str(next(target.model.parameters()).dtype).replace("torch.", ""))
    write_json_atomic(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    log.info("cache %s: %d samples, %d tokens, %s (%.1f bytes/token); %d shard(s) computed, %d new tokens in %.1f s = %.0f tok/s",
             out, len(samples), n_tokens, human_bytes(manifest["bytes"]), manifest["bytes"] / n_tokens, written, new_tokens,
             secs, new_tokens / secs if secs > 0 else 0.0)
    return manifest


def _resume_state(out: Path, fp: str) -> Optional[dict]:
    """What an earlier run left: None when the cache is complete and valid for
    this fingerprint; else the progress {fingerprint, shards: {file: sha256}} to
    keep (the damaged part of a finished cache is redone, the rest kept).
    Leaves no manifest behind while the cache is being (re)built."""
    manifest_path = out / MANIFEST
    progress = _read_state(out / PROGRESS)
    if manifest_path.exists():
        old = _read_state(manifest_path)
        if old.get("fingerprint") == fp:
            try:
                validate_cache(out)
                log.info("%s: up to date", out)
                return None
            except DeepSpecError as e:  # redo only what is damaged: the manifest's checksums say which
                log.warning("%s; rebuilding the damaged part", e)
                progress = {"fingerprint": fp, "shards": {x["file"]: x["sha256"] for x in old.get("shards", [])}}
        manifest_path.unlink()
    if progress.get("fingerprint") != fp:
        progress = {"fingerprint": fp, "shards": {}}
    return progress


def _write_shards(s: Settings, target, samples: TokenArrays, out: Path, progress: dict):
    """Compute and write every shard not kept from an earlier run (checksum
    ok), recording each in progress.json as it lands. Returns (manifest shard
    entries, shards written, tokens computed)."""
    from tqdm.auto import tqdm

    c = s.cache
    layers, dtype, lse = list(s.target.feature_layers), DTYPES[c.dtype], stores_log_normalizers(s)
    lengths = samples.lengths()
    shards = plan_shards(lengths, c.shard_tokens)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {shard_name(i) for i in range(len(shards))}
    for stale in out.glob("shard-*.safetensors"):
        if stale.name not in wanted or stale.name not in progress["shards"]:
            stale.unlink()
    entries, written, new_tokens, t0 = [], 0, 0, time.perf_counter()
    with tqdm(total=sum(lengths), desc="build-cache", unit="tok", unit_scale=True, dynamic_ncols=True) as bar:
        for i, (start, end) in enumerate(shards):
            name, path = shard_name(i), out / shard_name(i)
            digest = progress["shards"].get(name)
            if digest and path.exists() and sha256_file(path) == digest:
                log.info("%s: kept from an earlier run (checksum ok)", name)
                bar.update(sum(lengths[start:end]))
            else:
                rows: dict[int, tuple] = {}
                for batch in plan_batches(lengths, start, end, c.batch_size):
                    rows.update(zip(batch, compute_rows(target, layers, [samples[j] for j in batch], dtype, lse)))
                    new_tokens += sum(lengths[j] for j in batch)
                    bar.update(sum(lengths[j] for j in batch))
                    bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s", refresh=False)
                _write_shard(path, samples[start:end], [rows[j] for j in range(start, end)])
                digest = progress["shards"][name] = sha256_file(path)
                write_json_atomic(out / PROGRESS, progress)
                written += 1
            entries.append({"file": name, "sha256": digest, "bytes": path.stat().st_size,
                            "sample_start": start, "sample_end": end, "num_tokens": sum(lengths[start:end])})
    return entries, written, new_tokens


def cache_precision(s: Settings) -> str:
    """The dtype the cache's target forward computes in (cache.precision resolved
    on this machine, `runtime.resolve_precision`); cache.dtype is what is stored."""
    return resolve_precision(s.cache.precision, s.target.device, stage="build-cache")


def cache_target(s: Settings, target=None):
    """`target` when it is in the cache's compute dtype (`cache_precision`), else
    the preset's target loaded in it (on `target`'s device): the offline cache and
    online mode's features are computed alike."""
    from ..targets.loading import target_from_config

    want = cache_precision(s)
    if target is not None and next(target.model.parameters()).dtype == DTYPES[want]:
        return target
    return target_from_config(s, dtype=want, **({"device": str(target.device)} if target is not None else {}))


def _manifest(s: Settings, target_id: str, samples, stats: dict, hidden: int, fp: str, shards: list,
              compute_dtype: Optional[str] = None) -> dict:
    t, c = s.target, s.cache
    n_tokens = sum(samples.lengths())
    total_bytes = sum(x["bytes"] for x in shards)
    return {
        "format": FORMAT,
        "version": VERSION,
        "target_id": target_id,
        "target_name": t.name,
        "revision": t.revision,
        "feature_layers": list(t.feature_layers),
        "dtype": c.dtype,
        "compute_dtype": compute_dtype,
        "hidden_size": hidden,
        "feature_dim": hidden * len(t.feature_layers),
        "target_lse": stores_log_normalizers(s),
        "num_samples": len(samples),
        "num_tokens": n_tokens,
        "num_loss_tokens": int(np.count_nonzero(samples.loss_mask)),
        "dropped_samples": stats["dropped_min_loss_tokens"],
        "max_length": s.data.max_length,
        "min_loss_tokens": s.data.min_loss_tokens,
        "shard_tokens": c.shard_tokens,
        "batch_size": c.batch_size,
        "bytes": total_bytes,
        "bytes_per_token": round(total_bytes / n_tokens, 3),
        "fingerprint": fp,
        "shards": shards,
    }


# ---------------------------------------------------------------- validation


def read_manifest(cache_dir: str | os.PathLike) -> dict:
    d = Path(cache_dir)
    path = d / MANIFEST
    m = read_json(path, f"no target cache at {d}: {MANIFEST} missing (run python -m deepspec build-cache)")
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DeepSpecError(f"{path}: not a {FORMAT} v{VERSION} manifest (format {m.get('format')!r}, version {m.get('version')!r})")
    return m


def has_log_normalizers(manifest: Mapping) -> bool:
    """Whether a cache's shards hold target_lse (a manifest without the key predates it)."""
    return bool(manifest.get("target_lse", False))


def validate_cache(cache_dir: str | os.PathLike, *, checksums: bool = True) -> dict:
    """Check the manifest, every shard's presence, size, sha256 and layout; the
    first problem raises a one-line DeepSpecError naming the shard."""
    from safetensors import safe_open

    d = Path(cache_dir)
    m = read_manifest(d)
    expect = 0
    n_tok = 0
    widths = {"features": m["feature_dim"], "last_hidden": m["hidden_size"]}
    for sh in m["shards"]:
        p = d / sh["file"]
        if not p.exists():
            raise DeepSpecError(f"shard {sh['file']} missing from {d}")
        if p.stat().st_size != sh["bytes"]:
            raise DeepSpecError(f"shard {sh['file']} is corrupt: {p.stat().st_size} bytes, manifest says {sh['bytes']}")
        if checksums and sha256_file(p) != sh["sha256"]:
            raise DeepSpecError(f"shard {sh['file']} is corrupt: sha256 mismatch")
        if sh["sample_start"] != expect:
            raise DeepSpecError(f"{d / MANIFEST}: shard {sh['file']} starts at sample {sh['sample_start']}, expected {expect}")
        try:
            with safe_open(str(p), framework="pt") as f:
                offsets = f.get_tensor("offsets")
                names = ("input_ids", "loss_mask", *widths, *(("target_lse",) if has_log_normalizers(m) else ()))
                shapes = {k: f.get_slice(k).get_shape() for k in names}
                dtypes = {k: f.get_slice(k).get_dtype() for k in widths}
        except Exception as e:  # safetensors raises several types for a damaged header
            raise DeepSpecError(f"shard {sh['file']} is corrupt: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        n = sh["sample_end"] - sh["sample_start"]
        T = sh["num_tokens"]
        ok = len(offsets) == n + 1 and int(offsets[-1]) == T and all(s[0] == T for s in shapes.values())
        ok = ok and all(shapes[k][1:] == [w] for k, w in widths.items())
        if not ok:
            raise DeepSpecError(f"shard {sh['file']} is corrupt: tensor shapes do not match the manifest")
        want = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[m["dtype"]]
        if any(v != want for v in dtypes.values()):
            raise DeepSpecError(f"shard {sh['file']}: dtype {dtypes} but the manifest says {m['dtype']}")
        expect, n_tok = sh["sample_end"], n_tok + T
    if expect != m["num_samples"] or n_tok != m["num_tokens"]:
        raise DeepSpecError(f"{d / MANIFEST}: shards hold {expect} samples / {n_tok} tokens, manifest says "
                            f"{m['num_samples']} / {m['num_tokens']}")
    return m


# ---------------------------------------------------------------- CLI


def cli_build_cache(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec build-cache", description="cache the target's feature-layer and final hidden states")
    add_config_args(p)
    p.add_argument("--conversations", help="regenerated conversations (default: <results>/<target>/regen/conversations.jsonl)")
    p.add_argument("--out", help="cache directory (default: <results>/<target>/cache)")
    p.add_argument("--dry-run", action="store_true", help="print the estimated size and write nothing")
    args = p.parse_args(argv)
    build_cache(config_from_args(args), args.conversations, args.out, dry_run=args.dry_run)
    return 0


def cli_validate_cache(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec validate-cache", description="check a target cache's manifest and shard checksums")
    p.add_argument("cache_dir")
    p.add_argument("--no-checksums", action="store_true", help="skip the sha256 of every shard (sizes and layout only)")
    args = p.parse_args(argv)
    m = validate_cache(args.cache_dir, checksums=not args.no_checksums)
    print(f"ok: {args.cache_dir}: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} shard(s), "
          f"{human_bytes(m['bytes'])} ({m['bytes_per_token']} bytes/token), target {m['target_id']}, layers {m['feature_layers']}, {m['dtype']}")
    return 0

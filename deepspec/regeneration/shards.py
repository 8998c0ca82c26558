"""Regeneration in shards (workflow/rules/regenerate.smk, regenerate.shards = N):
N `regenerate --shard I/N` jobs each answer every N-th training prompt from the
I-th (`shard_of`), each into its own resumable file under regen/shards/ with its
own settings and errors files; `regenerate --merge` joins them (`merge_shards`)
into the conversations file, in the training prompts' order. Every record is
sampled from its own seed (`sampling.record_seed`), so its answer does not
depend on the shard it is in.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..config import rule_settings, settings_fingerprint
from ..data.prompts import Prompt, load_train_prompts
from ..errors import DeepSpecError
from ..files import atomic_path, read_json, require_file, write_json_atomic
from ..paths import RunPaths, errors_path, settings_path
from ..settings import Settings

log = logging.getLogger(__name__)


def parse_shard(arg: str) -> tuple[int, int]:
    """--shard "I/N" -> (I, N)."""
    try:
        shard, shards = (int(x) for x in arg.split("/"))
    except ValueError:
        raise DeepSpecError(f"--shard {arg!r}: expected I/N, e.g. 0/2") from None
    return shard, shards


def shard_of(prompts: list[Prompt], shard: int, shards: int) -> list[Prompt]:
    """The prompts of shard `shard` of `shards`: every shards-th from the shard-th,
    so each shard gets a like share of every source (and of long prompts)."""
    if not 0 <= shard < shards:
        raise DeepSpecError(f"--shard {shard}/{shards}: the shard must be in 0..{shards - 1}")
    return prompts[shard::shards]


def merge_shards(cfg: Settings | Mapping, shard_files: Sequence[str | os.PathLike], out: Optional[str | os.PathLike] = None, *,
                 prompts: Optional[list[Prompt]] = None) -> int:
    """The records of the shards' files as one conversations file `out`, in the
    order of `prompts`; their failures (and records skipped as too long)
    likewise in the errors file beside it. Every shard must come from
    `regenerate` under this run's settings, and every prompt must be in exactly
    one shard's records or errors. Returns the number of records.

    Streamed: a first pass reads each line once and keeps only where it is
    (file, offset, length: 16 bytes per record, in numpy arrays indexed by the
    prompt's rank); the second copies the lines, in rank order, into the output
    files. So the memory is the prompt ids and that index, never the records
    (1.2 M records of 5 KB: ~20 MB of index, not the ~34 GB of one joined string)."""
    import numpy as np

    s = Settings.view(cfg)
    out = Path(out) if out else RunPaths.of(s).conversations()
    ids = [p.id for p in (load_train_prompts(s) if prompts is None else prompts)]
    rank = {pid: i for i, pid in enumerate(ids)}
    fp = settings_fingerprint(s, "regenerate")
    files: list[tuple[Path, bool]] = []  # (file, holds records: True / errors: False)
    src = np.full(len(ids), -1, dtype=np.int32)
    off = np.zeros(len(ids), dtype=np.int64)
    size = np.zeros(len(ids), dtype=np.int32)
    n_recs = n_errs = 0
    used: list = []  # the dtypes the shards computed in (their settings files)
    for f in map(Path, shard_files):
        require_file(f, "regenerated shard")
        made_with = read_json(settings_path(f), default={})
        made = made_with.get("fingerprint")
        if made_with.get("precision") not in used:
            used.append(made_with.get("precision"))
        if made != fp:
            raise DeepSpecError(f"{f} was regenerated under other settings (fingerprint {made}, this run {fp}): "
                                "rerun its shard")
        for name, is_rec in ((f, True), (errors_path(f), False)):
            if not name.exists():
                continue
            k = len(files)
            files.append((name, is_rec))
            pos = 0
            with open(name, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    where, start = f"{name}:{lineno}", pos
                    pos += len(raw)
                    pid = _record_id(raw, where)
                    if pid is None:
                        continue  # a blank line
                    r = rank.get(pid) if isinstance(pid, str) else None
                    if r is None:
                        raise DeepSpecError(f"{where}: record {pid!r} is not a training prompt of this run")
                    if src[r] >= 0:
                        raise DeepSpecError(f"{where}: record {pid!r} is also in {files[src[r]][0]}")
                    src[r], off[r], size[r] = k, start, len(raw)
                    n_recs += is_rec
                    n_errs += not is_rec
    missing = np.flatnonzero(src < 0)
    if len(missing):
        raise DeepSpecError(f"{len(missing)} training prompts are in no shard (first: {ids[missing[0]]!r}): the shards "
                            f"given ({len(shard_files)}) are not all of this run's")
    handles = [open(name, "rb") for name, _ in files]
    try:
        with atomic_path(out) as tmp_out, atomic_path(errors_path(out)) as tmp_err:
            with open(tmp_out, "wb") as w_rec, open(tmp_err, "wb") as w_err:
                for r in range(len(ids)):
                    k = int(src[r])
                    h = handles[k]
                    h.seek(int(off[r]))
                    line = h.read(int(size[r]))
                    (w_rec if files[k][1] else w_err).write(line if line.endswith(b"\n") else line + b"\n")
    finally:
        for h in handles:
            h.close()
    write_json_atomic(settings_path(out), {"fingerprint": fp, "settings": rule_settings(s, "regenerate"),
                                           "precision": ", ".join(str(u) for u in used) if len(used) > 1 else (used or [None])[0]})
    log.info("merged %d shards: %d records, %d failed or skipped -> %s", len(shard_files), n_recs, n_errs, out)
    return n_recs


def _record_id(raw: bytes, where: str):
    """The id of one JSONL line (None for a blank line); a one-line error for
    what is not a record with an id."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DeepSpecError(f"{where}: not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DeepSpecError(f"{where}: malformed JSON ({e.msg})") from None
    pid = rec.get("id") if isinstance(rec, dict) else None
    if pid is None:
        raise DeepSpecError(f"{where}: not a record with an id")
    return pid

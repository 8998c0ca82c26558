"""Regeneration in shards (workflow/rules/regenerate.smk, regenerate.shards = N):
N `regenerate --shard I/N` jobs each answer every N-th training prompt from the
I-th (`shard_of`), each into its own resumable file under regen/shards/ with its
own settings and errors files; `regenerate --merge` joins them (`merge_shards`)
into the conversations file, in the training prompts' order. Every record is
sampled from its own seed (`regenerate.record_seed`), so its answer does not
depend on the shard it is in.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from ..config import rule_settings, settings_fingerprint
from ..errors import DeepSpecError
from ..files import iter_jsonl, read_json, require_file, write_json_atomic, write_text_atomic
from ..paths import RunPaths
from .prompts import Prompt, load_train_prompts
from ..paths import errors_path, settings_path

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


def merge_shards(cfg: dict, shard_files: Sequence[str | os.PathLike], out: Optional[str | os.PathLike] = None, *,
                 prompts: Optional[list[Prompt]] = None) -> int:
    """The records of the shards' files as one conversations file `out`, in the
    order of `prompts`; their failures likewise in the errors file beside it.
    Every shard must come from `regenerate` under this run's settings, and every
    prompt must be in exactly one shard's records or errors. Returns the number of records."""
    out = Path(out) if out else RunPaths.of(cfg).conversations()
    prompts = load_train_prompts(cfg) if prompts is None else prompts
    rank = {p.id: i for i, p in enumerate(prompts)}
    fp = settings_fingerprint(cfg, "regenerate")
    recs, errs, seen = [], [], {}
    for f in map(Path, shard_files):
        require_file(f, "regenerated shard")
        made = read_json(settings_path(f), default={}).get("fingerprint")
        if made != fp:
            raise DeepSpecError(f"{f} was regenerated under other settings (fingerprint {made}, this run {fp}): "
                                "rerun its shard")
        for name, rows in ((f, recs), (errors_path(f), errs)):
            if not name.exists():
                continue
            for _, where, rec in iter_jsonl(name, "regenerated shard"):
                pid = rec.get("id") if isinstance(rec, dict) else None
                if pid is None:
                    raise DeepSpecError(f"{where}: not a record with an id")
                if pid not in rank:
                    raise DeepSpecError(f"{where}: record {pid!r} is not a training prompt of this run")
                if pid in seen:
                    raise DeepSpecError(f"{where}: record {pid!r} is also in {seen[pid]}")
                seen[pid] = name
                rows.append(rec)
    missing = [p.id for p in prompts if p.id not in seen]
    if missing:
        raise DeepSpecError(f"{len(missing)} training prompts are in no shard (first: {missing[0]!r}): the shards "
                            f"given ({len(shard_files)}) are not all of this run's")
    for path, rows in ((out, recs), (errors_path(out), errs)):
        rows = sorted(rows, key=lambda r: rank[r["id"]])
        write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_json_atomic(settings_path(out), {"fingerprint": fp, "settings": rule_settings(cfg, "regenerate")})
    log.info("merged %d shards: %d records, %d failed -> %s", len(shard_files), len(recs), len(errs), out)
    return len(recs)

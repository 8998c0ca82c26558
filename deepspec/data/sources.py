"""The prepare_data rule: build the preset's prompt files under the data root
from their public sources when they are missing. The data root
(`prompts.data_root`) is ``$DEEPSPEC_DATA`` when set, else `data.root`: by
default ``data/`` inside the repository (git-ignored), empty in a fresh clone.

Every file a preset reads (its `data.train` files and `data.benchmarks` files;
``hub:`` sources are read directly and need nothing here) has a known source in
`catalog.KNOWN_SOURCES`, keyed by its path under `data.root`: a Hugging Face dataset
(id, config, split, pinned revision) read with `datasets.load_dataset`, or
named files of a dataset repository (`huggingface_hub.hf_hub_download`) or of
a GitHub repository at a pinned commit (``github:owner/repo``, downloaded by
`datasets.DownloadManager`). A preset can change any field per file under
`data.sources` (e.g. another revision). The formats are DeepSeek's DeepSpec
``eval_datasets`` (``{"turns": [...]}`` per line, ``json.dumps(...,
ensure_ascii=False)``) for the benchmarks, and for the training files the same
records plus ``reference`` (the source dataset's response, when it has one);
with the pinned sources each file is byte-identical to the reference copy (a
prepared data directory), whose sha256 `KNOWN_SOURCES` holds.

- A file that exists is never rewritten and nothing is downloaded for it.
- A file's sha256 is pinned: by the reference copy's (`Source.sha256`, or
  ``data.sources[path].sha256``), or, once built, by its line in
  ``<data.root>/SHA256SUMS`` (the ``sha256sum`` format). A sha that differs
  from its pin is one DeepSpecError line naming the file: nothing is written
  and SHA256SUMS is untouched, unless the file is named in
  ``--accept-changed-sources`` (then it is written and recorded, with a
  warning). SHA256SUMS holds only files that matched their pin, had none, or
  were accepted by name.
- A file built here also gets an entry in ``<data.root>/SOURCES.json``: its
  source, requested revision, the commit that resolved to and its sha256
  (read by the report's provenance record, `deepspec.provenance`).
- A missing file that cannot be downloaded (offline, ``HF_HUB_OFFLINE=1``, the
  hub unreachable) is one DeepSpecError line naming the file, its source and
  how to get it.
- ``--hub-mirror DIR`` reads every source from ``DIR/<hub id>`` (GitHub sources
  from ``DIR/github.com/<owner>/<repo>``) instead of the network: an air-gapped
  mirror, and how the tests run the conversions.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

from ..errors import DeepSpecError
from ..files import atomic_path, file_lock, sha256_file, write_text_atomic
from ..runtime import OFFLINE_VARIABLES, hub_offline
from ..settings import Settings
from .catalog import FORMATS, KNOWN_SOURCES, Source
from .prompts import data_root, is_prompt_file

log = logging.getLogger(__name__)

SUMS_FILE = "SHA256SUMS"


# ---------------------------------------------------------------- which files


def needed_files(cfg: Settings | Mapping) -> list[str]:
    """The preset's prompt files under data.root (hub: and synthetic: sources excluded), in order."""
    d = Settings.view(cfg).data
    paths = [e["path"] for e in d.train] + [b["path"] for b in d.benchmarks.values()]
    return list(dict.fromkeys(p for p in paths if is_prompt_file(p)))


def source_for(cfg: Settings | Mapping, rel: str) -> Optional[Source]:
    """The known source of `rel`, with the preset's `data.sources[rel]` fields applied."""
    over = dict(Settings.view(cfg).data.sources.get(rel) or {})
    base = KNOWN_SOURCES.get(rel)
    if base is None and "hub" not in over:
        return None
    if "files" in over:
        over["files"] = tuple(over["files"] or ())
    if base is None:
        over.setdefault("format", "prompt")
        return Source(**over)
    return dataclasses.replace(base, **over)


def check_sources(cfg: Settings | Mapping) -> None:
    """Plan-time check: every missing file can be built (one line otherwise)."""
    s = Settings.view(cfg)
    root = data_root(s)
    for rel in needed_files(s):
        if not (root / rel).exists() and source_for(s, rel) is None:
            raise DeepSpecError(
                f"prompt file {root / rel} is missing and has no known source: copy it there, set DEEPSPEC_DATA "
                f"or data.root to a directory that has it, or give its source under data.sources")


# ---------------------------------------------------------------- reading sources


def _local_repo(src: Source, mirror: Optional[Path]) -> Optional[Path]:
    if mirror is None:
        return None
    if src.hub.startswith("github:"):
        return Path(mirror) / "github.com" / src.hub[len("github:"):]
    return Path(mirror) / src.hub


def _download(src: Source, mirror: Optional[Path]) -> list[Path]:
    """Local paths of the source's files (from the mirror, the hub or GitHub)."""
    local = _local_repo(src, mirror)
    if local is not None:
        paths = [local / f for f in src.files]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"not in the mirror: {p}")
        return paths
    if src.hub.startswith("github:"):
        import datasets

        rev = src.revision or "HEAD"
        urls = [f"https://raw.githubusercontent.com/{src.hub[len('github:'):]}/{rev}/{f}" for f in src.files]
        return [Path(p) for p in datasets.DownloadManager().download(urls)]
    from huggingface_hub import hf_hub_download

    return [Path(hf_hub_download(src.hub, f, repo_type="dataset", revision=src.revision)) for f in src.files]


def _file_rows(path: Path, lenient: bool, skipped: list) -> Iterator[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    elif path.suffix == ".json":
        yield from json.loads(path.read_text(encoding="utf-8"))
    else:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    if not lenient:
                        raise DeepSpecError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
                    skipped.append(f"{path.name}:{lineno}")


def _open_rows(src: Source, mirror: Optional[Path], skipped: list, fetched: Optional[list] = None) -> Iterable[dict]:
    """The source's rows; everything that touches the network happens here.
    The local paths of downloaded files are appended to `fetched`."""
    if src.files:
        paths = _download(src, mirror)
        if fetched is not None:
            fetched.extend(paths)
        return (row for p in paths for row in _file_rows(p, src.lenient, skipped))
    import datasets

    local = _local_repo(src, mirror)
    path = str(local) if local is not None else src.hub
    return datasets.load_dataset(path, src.config, split=src.split, revision=src.revision)


# ---------------------------------------------------------------- converting


def convert_rows(rows: Iterable[dict], src: Source, where: str) -> list[dict]:
    """Records `{"turns": [...], "reference"?: str}` of the source rows."""
    fmt = FORMATS.get(src.format)
    if fmt is None:
        raise DeepSpecError(f"{where}: unknown format '{src.format}' (known: {', '.join(FORMATS)})")
    out, seen = [], set()
    for i, row in enumerate(rows):
        try:
            got = fmt(row)
        except (KeyError, TypeError) as e:
            raise DeepSpecError(f"{where}: row {i} of {src.where} does not fit format '{src.format}' "
                                f"({type(e).__name__}: {e})") from None
        if got is None:
            continue
        turns, ref = got
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DeepSpecError(f"{where}: row {i} of {src.where} gives an empty or non-text turn")
        key = json.dumps(turns)
        if src.dedup and key in seen:
            continue
        seen.add(key)
        rec = {"turns": list(turns)}
        if isinstance(ref, str) and ref:
            rec["reference"] = ref
        out.append(rec)
    if not out:
        raise DeepSpecError(f"{where}: {src.where} gave no records")
    return out


def encode_records(records: list[dict]) -> bytes:
    """The JSONL bytes of the records (DeepSpec's ``json.dumps(..., ensure_ascii=False)`` lines)."""
    return "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")


def write_records(path: Path, data: bytes) -> None:
    """Write the JSONL bytes atomically."""
    with atomic_path(path, suffix=".jsonl") as tmp:
        tmp.write_bytes(data)


# ---------------------------------------------------------------- checksums


def read_sums(root: Path) -> dict[str, str]:
    """`<root>/SHA256SUMS` as {relative path: sha256} ({} when absent)."""
    path = Path(root) / SUMS_FILE
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        sha, _, rel = line.partition("  ")
        if sha and rel:
            out[rel.strip()] = sha.strip()
    return out


def record_sum(root: Path, rel: str, sha: str) -> None:
    """Add or replace `rel`'s line in SHA256SUMS (locked: parallel jobs share it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{SUMS_FILE}.lock"):
        sums = read_sums(root)
        sums[rel] = sha
        write_text_atomic(root / SUMS_FILE, "".join(f"{s}  {r}\n" for r, s in sorted(sums.items())))


def check_sha(rel: str, sha: str, src: Optional[Source], recorded: Optional[str] = None,
              accept: bool = False, built: bool = False) -> bool:
    """Check `sha` against its pin. A file present: the sha recorded in
    SHA256SUMS when it was built (or accepted), else the reference copy's. A
    file just built: the reference copy's, else (a source without one) the
    recorded one. A mismatch is one DeepSpecError line naming the file, unless
    `accept` (the user named the file in --accept-changed-sources): then a
    warning, and False is returned (the caller records the new sha)."""
    ref = src.sha256 if src is not None else None
    upstream = (f"differs from the reference copy's ({ref}): {src.where} may have changed upstream, "
                "so prompts (and results) would differ from the reference run's") if ref and ref != sha else None
    if built and ref:
        why = upstream
    elif recorded:
        why = (f"differs from the one in {SUMS_FILE} ({recorded}): "
               + ("its source changed since the file was built" if built else "the file changed after it was built")
               ) if recorded != sha else None
    else:
        why = upstream
    if why is None:
        return True
    if accept:
        log.warning("%s: sha256 %s %s; accepted (--accept-changed-sources)", rel, sha, why)
        return False
    hint = f" (or give its sha256 under data.sources['{rel}'] in the preset)" if why is upstream else ""
    raise DeepSpecError(
        f"{rel}: sha256 {sha} {why}; " + ("nothing written" if built else "file left as it is")
        + f": to use it anyway run prepare-data with --accept-changed-sources {rel}{hint}")


def source_provenance(src: Source, mirror: Optional[Path], fetched: list, sha: str) -> dict:
    """What a built file came from: the source, the requested revision and the
    commit it resolved to (`commit_from`: pinned, the hub cache's snapshot
    directory, or the hub's answer for the revision), and its sha256."""
    from ..provenance import dataset_commit, is_commit, now_utc

    rec = {"source": src.where, "hub": src.hub, "revision": src.revision, "sha256": sha, "built_at": now_utc()}
    if mirror is not None:
        rec.update(mirror=str(mirror), commit=src.revision if is_commit(src.revision) else None,
                   commit_from="pinned revision, read from the mirror" if is_commit(src.revision)
                   else "unresolved (read from a mirror)")
    elif src.hub.startswith("github:"):
        rec.update(commit=src.revision if is_commit(src.revision) else None,
                   commit_from="pinned" if is_commit(src.revision) else "unresolved (GitHub HEAD)")
    else:
        commit, how = dataset_commit(src.hub, src.revision, fetched)
        rec.update(commit=commit, commit_from=how)
    return rec


def record_source(root: Path, rel: str, rec: dict) -> None:
    """Add or replace `rel`'s entry in <root>/SOURCES.json (provenance.DATA_SOURCES_FILE; locked as SHA256SUMS)."""
    from ..files import read_json, write_json_atomic
    from ..provenance import DATA_SOURCES_FILE

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{DATA_SOURCES_FILE}.lock"):
        recs = read_json(root / DATA_SOURCES_FILE, default={})
        recs[rel] = rec
        write_json_atomic(root / DATA_SOURCES_FILE, dict(sorted(recs.items())))


# ---------------------------------------------------------------- the command


def _missing(path: Path, src: Source, preset: str, reason: str) -> DeepSpecError:
    reason = " ".join(reason.split())[:200]
    return DeepSpecError(
        f"prompt file {path} is missing and could not be built from {src.where} ({reason}); "
        f"with internet access run `python -m deepspec prepare-data --preset {preset}`, or copy the file there "
        f"(or set DEEPSPEC_DATA to a directory that has it)")


def build_file(cfg: Settings | Mapping, rel: str, mirror: Optional[Path] = None, offline: bool = False,
               accept: bool = False) -> str:
    """Build data.root/rel from its source, check its sha256 against the pin
    before anything is written (a mismatch raises unless `accept`), write and
    record it; return the sha256."""
    s = Settings.view(cfg)
    root = data_root(s)
    path = root / rel
    src = source_for(s, rel)
    if src is None:
        check_sources(s)  # raises for a missing file
        raise DeepSpecError(f"prompt file {path}: no known source (give one under data.sources)")
    if mirror is None and (offline or hub_offline()):
        raise _missing(path, src, s.preset, f"offline: --offline or {'/'.join(OFFLINE_VARIABLES)} is set")
    skipped: list = []
    fetched: list = []
    try:
        rows = _open_rows(src, mirror, skipped, fetched)
    except DeepSpecError:
        raise
    except Exception as e:  # no network, unknown repo or file, gated dataset, ...
        raise _missing(path, src, s.preset, f"{type(e).__name__}: {e}") from None
    records = convert_rows(rows, src, str(path))
    if skipped:
        log.info("%s: skipped %d malformed source lines (%s)", rel, len(skipped), ", ".join(skipped[:5]))
    data = encode_records(records)
    sha = hashlib.sha256(data).hexdigest()
    check_sha(rel, sha, src, read_sums(root).get(rel), accept=accept, built=True)
    write_records(path, data)
    record_sum(root, rel, sha)
    record_source(root, rel, source_provenance(src, mirror, fetched, sha))
    log.info("%s: %d records from %s -> %s (sha256 %s)", rel, len(records), src.where, path, sha)
    return sha


def prepare_data(cfg: Settings | Mapping, files: Optional[list] = None, mirror: Optional[Path] = None,
                 offline: bool = False, accept: Iterable[str] = ()) -> dict[str, str]:
    """Build the missing files among `files` (default: every file the preset
    reads); check the sha256 of those present. A sha256 that differs from its
    pin is an error unless the file is in `accept` (paths under data.root).
    Returns {file: "built" | "present"}."""
    s = Settings.view(cfg)
    root = data_root(s)
    files = list(files) if files else needed_files(s)
    accept = set(accept)
    unknown = sorted(accept - set(files))
    if unknown:
        raise DeepSpecError(f"--accept-changed-sources: {', '.join(unknown)} is not among the files checked here "
                            f"({', '.join(files)})")
    sums = read_sums(root)
    status = {}
    for rel in files:
        path = root / rel
        if path.exists():
            sha = sha256_file(path)
            if not check_sha(rel, sha, source_for(s, rel), sums.get(rel), accept=rel in accept):
                record_sum(root, rel, sha)
            status[rel] = "present"
        else:
            log.info("%s: missing under %s, building it", rel, root)
            build_file(s, rel, mirror, offline, accept=rel in accept)
            status[rel] = "built"
    return status


def cli_prepare_data(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(
        prog="deepspec prepare-data",
        description="build the preset's missing prompt files under data.root from their public sources "
                    "(Hugging Face hub, pinned revisions); files present are only checked against their sha256")
    add_config_args(p)
    p.add_argument("--file", dest="files", action="append", default=[], metavar="PATH",
                   help="a file under data.root (e.g. eval/gsm8k.jsonl; repeatable); default: all the preset reads")
    p.add_argument("--hub-mirror", type=Path, default=None, metavar="DIR",
                   help="read sources from DIR/<hub id> (GitHub ones from DIR/github.com/<owner>/<repo>)")
    p.add_argument("--offline", action="store_true", help="never download: a missing file is an error")
    p.add_argument("--accept-changed-sources", dest="accept", action="append", default=[], metavar="PATH[,PATH]",
                   help="files (paths under data.root, repeatable) whose sha256 may differ from the pinned one: "
                        "written and recorded in SHA256SUMS anyway; default: such a file is an error")
    args = p.parse_args(argv)
    s = Settings.of(config_from_args(args))
    accept = [a.strip() for arg in args.accept for a in arg.split(",") if a.strip()]
    status = prepare_data(s, args.files, args.hub_mirror, args.offline, accept)
    built = [f for f, state in status.items() if state == "built"]
    log.info("data under %s: %d files present, %d built%s", data_root(s), len(status) - len(built), len(built),
             f" ({', '.join(built)})" if built else "")
    return 0

"""Hub snapshots fetched once, at the revision the preset pins: the training
datasets (``data.train`` entries ``hub:<dataset id>`` with their ``revision``)
and DeepSeek's released drafters (``eval.released_checkpoints.<method>:
{hub, revision}``).

The DAG fetches them with local rules (workflow/rules/prepare_data.smk:
`fetch_dataset`, `fetch_released`), i.e. where Snakemake runs, which on a
cluster has the internet access compute nodes may lack; the jobs that read
them (regeneration, evaluation) then find them on disk. A snapshot is
downloaded into the hub cache (HF_HOME) and its files are hard linked (copied
where links fail) into ``<resources>/hub/<datasets|models>/<owner>--<name>@<revision>/``
(`RunPaths.hub_snapshot`), with `provenance.SOURCE_FILE` written last: the
repository, the requested revision and the commit it resolved to. The
directory appears complete or not at all; one that exists is never fetched
again (a changed revision is another directory), and one we did not write is
never replaced.

A revision is a commit (pinned), or a branch or tag (then the commit it
resolved to at the fetch is what the record holds, and a warning says the
input is not pinned). Commands run by hand fetch what is missing themselves.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

from .errors import DeepSpecError, first_line
from .files import atomic_dir, write_json_atomic
from .paths import RunPaths
from .provenance import SOURCE_FILE, is_commit, now_utc, read_record, snapshot_commit
from .settings import Settings

log = logging.getLogger(__name__)

REPO_TYPES = ("dataset", "model")
RELEASED_FILES = ["*.json", "*.safetensors"]  # a released drafter: config + weights


def not_a_hub_id(name: str) -> bool:
    """Whether `name` is a local model rather than a hub id: a path that exists, or
    not of the hub's `[owner/]name` form (what vLLM >= 0.34 refuses as a speculators
    verifier, and what a model card cannot name as its base model)."""
    import re

    parts = name.split("/")
    hub_id = (len(parts) <= 2 and all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", x) for x in parts)
              and ".." not in name and "--" not in name)
    return not hub_id or Path(name).exists() or Path(name).is_symlink()


def snapshot_name(repo_id: str, revision: str) -> str:
    """<owner>--<name>@<revision> (a '/' of a revision becomes '--')."""
    return f"{repo_id.replace('/', '--')}@{revision.replace('/', '--')}"


def hub_datasets(cfg: Settings | Mapping) -> dict[str, tuple[str, str]]:
    """{snapshot name: (dataset id, revision)} of the preset's hub: training sources."""
    out = {}
    for e in Settings.view(cfg).data.train:
        if e["path"].startswith("hub:"):
            repo = e["path"][4:]
            out[snapshot_name(repo, e["revision"])] = (repo, e["revision"])
    return out


def released_hub(cfg: Settings | Mapping) -> dict[str, tuple[str, str]]:
    """{method: (hub id, revision)} of the released checkpoints given as {hub, revision}
    (a string is a local directory)."""
    released = Settings.view(cfg).eval.released_checkpoints
    return {m: (v["hub"], v["revision"]) for m, v in released.items() if isinstance(v, dict)}


def snapshot_dir(cfg: Settings | Mapping, repo_type: str, repo_id: str, revision: str) -> Path:
    return RunPaths.of(cfg).hub_snapshot(f"{repo_type}s", snapshot_name(repo_id, revision))


def _link_tree(src: Path, dst: Path) -> None:
    """Every file under src at the same place under dst: hard links to the real
    files (the hub cache's snapshot files are symlinks to its blobs), copies where
    the file system refuses links."""
    for f in sorted(src.rglob("*")):
        if not f.is_file() or ".cache" in f.relative_to(src).parts:
            continue
        to = dst / f.relative_to(src)
        to.parent.mkdir(parents=True, exist_ok=True)
        real = f.resolve()
        try:
            os.link(real, to)
        except OSError:
            shutil.copy2(real, to)


def fetch_snapshot(repo_id: str, revision: str, out: str | os.PathLike, *, repo_type: str = "model",
                   allow_patterns: Optional[list] = None) -> Path:
    """`out` holding the hub repository `repo_id` at `revision` (see the module
    docstring); nothing is downloaded when it is already there."""
    from huggingface_hub import snapshot_download

    if repo_type not in REPO_TYPES:
        raise DeepSpecError(f"repository type {repo_type!r}: one of {', '.join(REPO_TYPES)}")
    if not revision:
        raise DeepSpecError(f"{repo_id}: no revision: pin one (a commit of the hub repository)")
    out = Path(out)
    rec = read_record(out / SOURCE_FILE)
    if rec is not None:
        if (rec.get("repo_id"), rec.get("revision")) != (repo_id, revision):
            raise DeepSpecError(f"{out} holds {rec.get('repo_id')}@{rec.get('revision')}, not {repo_id}@{revision}")
        return out
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # made empty by Snakemake for the record file
    try:
        snap = Path(snapshot_download(repo_id=repo_id, repo_type=repo_type, revision=revision,
                                      allow_patterns=allow_patterns))
    except (OSError, ValueError) as e:  # huggingface_hub's errors (gated, missing, offline) derive from these
        first = first_line(e)
        raise DeepSpecError(f"cannot download the {repo_type} {repo_id!r} at revision {revision!r}: "
                            f"{type(e).__name__}: {first}") from None
    commit = snapshot_commit(snap) or snapshot_commit(snap.resolve())
    if not is_commit(revision):
        log.warning("%s: revision %r is not a commit: it resolved to %s now; pin that commit in the preset",
                    repo_id, revision, commit)
    with atomic_dir(out) as tmp:  # an existing directory that is not ours: one line, untouched
        _link_tree(snap, tmp)
        if not any(tmp.iterdir()):
            raise DeepSpecError(f"{repo_id}@{revision}: no files{f' matching {allow_patterns}' if allow_patterns else ''}")
        write_json_atomic(tmp / SOURCE_FILE, {"kind": "hub", "repo_type": repo_type, "repo_id": repo_id,
                                              "revision": revision, "commit": commit, "snapshot": str(snap),
                                              "fetched_at": now_utc()})
    log.info("fetched %s %s@%s (commit %s) into %s", repo_type, repo_id, revision, commit, out)
    return out


def fetched(cfg: Settings | Mapping, repo_type: str, repo_id: str, revision: str, allow_patterns=None) -> Path:
    """The preset's snapshot directory of `repo_id`@`revision`; fetched now (with a
    warning) when the DAG's local rule has not fetched it (a command run by hand)."""
    out = snapshot_dir(cfg, repo_type, repo_id, revision)
    if read_record(out / SOURCE_FILE) is None:
        log.warning("%s@%s is not fetched yet (the DAG's fetch rules do it where Snakemake runs): fetching it now",
                    repo_id, revision)
        fetch_snapshot(repo_id, revision, out, repo_type=repo_type, allow_patterns=allow_patterns)
    return out


def cli_fetch_hub(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec fetch-hub",
                                description="fetch a hub repository at a pinned revision into a directory of its own")
    p.add_argument("--repo", required=True, help="hub id (owner/name)")
    p.add_argument("--revision", required=True, help="commit (pinned), or branch / tag")
    p.add_argument("--repo-type", choices=REPO_TYPES, default="model")
    p.add_argument("--allow", action="append", default=None, help="file patterns to fetch (repeatable; default: all)")
    p.add_argument("--out", required=True, help="the snapshot directory (RunPaths.hub_snapshot)")
    args = p.parse_args(argv)
    fetch_snapshot(args.repo, args.revision, args.out, repo_type=args.repo_type, allow_patterns=args.allow)
    return 0

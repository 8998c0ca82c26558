"""Files: atomic writes (temp file, then rename), JSON / JSONL / CSV reading and
writing with one-line errors naming the file and line."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import DeepSpecError


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` on success.

    Nothing half-written is ever visible under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():  # mkstemp creates 0600; give the usual umask-based mode
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike, overwrite: bool = True) -> None:
    """Rename the finished directory `tmp` onto `out`. An existing `out` is
    removed first when `overwrite`, else is a one-line DeepSpecError."""
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        if not overwrite:
            raise DeepSpecError(f"output {out} exists (use --overwrite)")
        shutil.rmtree(out)
    os.replace(tmp, out)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, merge: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; on success it becomes
    `out` (see `replace_dir`), on failure it is removed.

    merge: `out` is a directory that holds other things (a training run's
    output); the temporary directory is made inside it, and on success its
    entries are moved into `out`, config.json last, so that a reader waiting
    for config.json finds the model complete. Existing entries of the same
    name are replaced.
    """
    out = Path(out)
    parent = out if merge else out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the mode mkdir would
    try:
        yield tmp
        if merge:
            names = sorted(p.name for p in tmp.iterdir())
            for name in [x for x in names if x != "config.json"] + [x for x in names if x == "config.json"]:
                os.replace(tmp / name, out / name)
        else:
            replace_dir(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


_RAISE = object()


def read_json(path: str | os.PathLike, missing: str = "", default: Any = _RAISE) -> Any:
    """The JSON value stored in `path`. A missing file returns `default` when one
    is given, else is a one-line DeepSpecError (message `missing`); malformed
    JSON is always a one-line DeepSpecError."""
    path = Path(path)
    if not path.exists():
        if default is not _RAISE:
            return default
        raise DeepSpecError(missing or f"file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DeepSpecError(f"{path}: malformed JSON ({e.msg})") from None


def json_safe(obj: Any) -> Any:
    """A JSON-safe copy: NaN/inf -> null, numpy scalars -> Python numbers."""
    import numpy as np

    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def write_csv_atomic(df, path: str | os.PathLike) -> None:
    """A pandas DataFrame as CSV (no index), atomically."""
    with atomic_path(path, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, *paths: str | os.PathLike, dpi: int = 150) -> None:
    """A matplotlib figure to each path (format from its suffix), atomically."""
    for out in map(Path, paths):
        with atomic_path(out, suffix=out.suffix) as tmp:
            fig.savefig(tmp, format=out.suffix.lstrip("."), dpi=dpi)


def iter_jsonl(path: str | os.PathLike, what: str = "file", hint: str = ""):
    """(line number, "file:line", record) for every non-blank line of a JSONL
    file; a missing file or a malformed line is a one-line DeepSpecError."""
    path = Path(path)
    if not path.exists():
        raise DeepSpecError(f"{what} not found: {path}{hint}")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DeepSpecError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DeepSpecError(f"{where}: malformed JSON ({e.msg})") from None
            yield lineno, where, rec


def require_file(path: str | os.PathLike, what: str = "file", hint: str = "") -> Path:
    p = Path(path)
    if not p.exists():
        raise DeepSpecError(f"{what} not found: {p}{hint}")
    return p


def recover_jsonl(path: Path) -> set[str]:
    """Ids already in an append-only JSONL; a truncated or invalid last line is cut off."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    done: set[str] = set()
    good = 0
    lines = data.split(b"\n")
    for k, line in enumerate(lines):
        last = k == len(lines) - 1
        if last and not line:
            break
        try:
            rec = json.loads(line)
            if last:
                raise ValueError("no newline")  # a complete record always ends with one
            done.add(rec["id"])
        except (ValueError, KeyError, TypeError):
            if k >= len(lines) - 2:  # the tail: drop it
                logging.getLogger(__name__).warning("%s: dropping a truncated last line", path)
                break
            raise DeepSpecError(f"{path}:{k + 1}: corrupt record in the middle of the file") from None
        good += len(line) + 1
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


class JsonlAppender:
    """Append whole lines and fsync, so a kill never leaves a half record behind
    (and if it does, `recover_jsonl` cuts it off)."""

    def __init__(self, path: Path, mode: str = "a"):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, mode, encoding="utf-8")

    def write(self, recs: list[dict]) -> None:
        if recs:
            self.f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            self.f.flush()
            os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, busy: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created, and removed again on the way
    out) or stop at once with the one-line DeepSpecError `busy` when another
    process holds it. Where the filesystem has no file locks: no lock, a warning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise DeepSpecError(f"{busy} (lock {path})") from None
        except OSError as e:
            f.close()
            if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            logging.getLogger(__name__).warning("%s: no file locks on this filesystem (%s); going on without one",
                                                path, e.strerror)
            yield
            return
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break  # else the holder removed it as we opened it: take the new one
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still holding it (see the inode check above)
        f.close()

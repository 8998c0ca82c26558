"""Files: atomic writes (temp file, then rename), JSON / JSONL / CSV reading and
writing with one-line errors naming the file and line.

Every directory the atomic writers make whole holds `OUTPUT_MARKER` (not a
training run's, into which they merge); `--overwrite` replaces only such a
directory, never one this project did not write, nor a training run. A write
that fails for a reason of the file system (disk full, read-only, permissions;
also when a library reports it in other words, as safetensors and torch.save
do) leaves nothing half-written and raises an OSError naming the output, which
the CLI prints as one line (`deepspec.cli`)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

from .errors import DeepSpecError

OUTPUT_MARKER = ".deepspec-output"  # in every directory the atomic writers make: --overwrite may replace it


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def os_error(e: BaseException, out: str | os.PathLike) -> OSError | None:
    """The OSError that a failed write of output `out` amounts to, naming `out`
    (or the path the error names, when that is not a temporary file of ours):
    e itself; one that a library reports only in its message (safetensors:
    '... No space left on device (os error 28)'); ENOSPC when e says nothing of
    the cause but the file system under `out` is full (torch.save's
    'PytorchStreamWriter failed' / 'unexpected pos'). None for other errors."""
    out = Path(out)
    if isinstance(e, OSError):
        code, name = e.errno, e.filename
    elif m := re.search(r"\(os error (\d+)\)", str(e)):
        code, name = int(m.group(1)), None
    elif isinstance(e, RuntimeError) and _disk_full(out):
        code, name = errno.ENOSPC, None
    else:
        return None
    if code is None:
        return None
    if name is None or any(part.startswith(f".{out.name}.") for part in Path(str(name)).parts):
        name = str(out)  # not the temporary file or directory, which is gone
    return OSError(code, os.strerror(code), name)


def _disk_full(path: Path) -> bool:
    """Less than 1 MiB left for ordinary users on the file system holding `path`."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < 1 << 20
    except OSError:
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def removed_on_failure(tmp: str | os.PathLike | None, out: str | os.PathLike) -> Iterator[None]:
    """Write output `out` through the temporary file or directory `tmp`: if the
    block fails, tmp is removed (None: another process removes it), and a
    failure of the file system becomes an OSError naming `out` (`os_error`)."""
    try:
        yield
    except BaseException as e:
        if tmp is not None:
            _remove(Path(tmp))
        oe = os_error(e, out) if isinstance(e, Exception) else None
        if oe is None:
            raise
        raise oe from e


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` on success.

    Nothing half-written is ever visible under the final name.
    """
    path = Path(path)
    with removed_on_failure(None, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
        os.close(fd)
    tmp = Path(tmp)
    with removed_on_failure(tmp, path):
        yield tmp
        if tmp.exists():  # mkstemp creates 0600; give the usual umask-based mode
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)


def _umask_modes(tmp: Path) -> None:
    """Give the files in directory `tmp` the mode open() gives under the umask:
    libraries make some 0600 (safetensors writes through a temporary file of its
    own). Hard links (a hub target's files) keep the linked file's mode."""
    umask = _umask()
    for p in tmp.rglob("*"):
        st = p.lstat()
        if p.is_file() and not p.is_symlink() and st.st_nlink == 1:
            os.chmod(p, (0o777 if st.st_mode & 0o111 else 0o666) & ~umask)


def check_overwrite(out: str | os.PathLike, overwrite: bool) -> None:
    """Refuse, in one line, to write output directory `out` over what is there:
    anything at all without `overwrite`; with it, anything but a directory that
    an atomic writer of this project made (it holds `OUTPUT_MARKER`) or an empty
    one (Snakemake makes the folders of a rule's output files before the job)."""
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not out.is_symlink() and overwrite and not any(out.iterdir()):
        return
    if not overwrite:
        raise DeepSpecError(f"output {out} exists (use --overwrite)")
    if out.is_symlink() or not out.is_dir() or not (out / OUTPUT_MARKER).is_file():
        what = "a symbolic link" if out.is_symlink() else "not a directory" if not out.is_dir() else \
            f"not an output directory deepspec wrote (no {OUTPUT_MARKER} in it)"
        raise DeepSpecError(f"output {out} is {what}: --overwrite replaces only deepspec's own outputs; "
                            "remove it yourself or choose another output")


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike, overwrite: bool = True) -> None:
    """Rename the finished directory `tmp` onto `out`, marked as ours
    (`OUTPUT_MARKER`), its files in their umask mode. An existing `out` is removed first when
    `overwrite` and it is one of ours, else is a one-line DeepSpecError
    (`check_overwrite`)."""
    tmp, out = Path(tmp), Path(out)
    check_overwrite(out, overwrite)
    (tmp / OUTPUT_MARKER).write_text("written by deepspec; --overwrite may replace this directory\n")
    _umask_modes(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, merge: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; on success it becomes
    `out` (see `replace_dir`), on failure it is removed (a failure of the file
    system: an OSError naming `out`, `removed_on_failure`).

    merge: `out` is a directory that holds other things (a training run's
    output); the temporary directory is made inside it, and on success its
    entries are moved into `out`, config.json last, so that a reader waiting
    for config.json finds the model complete. Existing entries of the same
    name are replaced.
    """
    out = Path(out)
    parent = out if merge else out.parent
    with removed_on_failure(None, out):
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    with removed_on_failure(tmp, out):
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the mode mkdir would
        yield tmp
        if merge:  # no OUTPUT_MARKER: `out` holds more than this (a training run: its checkpoints)
            _umask_modes(tmp)
            names = sorted(p.name for p in tmp.iterdir())
            for name in [x for x in names if x != "config.json"] + [x for x in names if x == "config.json"]:
                os.replace(tmp / name, out / name)
            tmp.rmdir()
        else:
            replace_dir(tmp, out, overwrite)


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


def read_json_object(path: str | os.PathLike, what: str, missing: str = "") -> dict:
    """`read_json` of a file that holds one JSON object (`what` it is, for the error):
    any other value is a one-line DeepSpecError naming the file."""
    obj = read_json(path, missing)
    if not isinstance(obj, dict):
        raise DeepSpecError(f"{path}: {what} is a JSON object, not {type(obj).__name__}")
    return obj


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


class ResumableLog:
    """The finished work of a job that may be killed: one JSON record per line,
    keyed by its "id", appended and fsync'd as each piece finishes, so that a rerun
    resumes where the last one stopped (a torn last line, a kill mid-write, is cut
    off). The log belongs to one settings `fingerprint` (any JSON value), kept in
    its first line, or, for a log that becomes an output of its own (regeneration's
    conversations), in the JSON file `sidecar` with the fields of `record`. Opened
    under other settings, the log and the files in `stale` are discarded."""

    HEADER_ID = "#settings"

    def __init__(self, path: str | os.PathLike, fingerprint, *, sidecar: Optional[Path] = None,
                 record: Optional[dict] = None, stale: tuple = ()):
        self.path, self.sidecar, self.fingerprint = Path(path), sidecar, fingerprint
        self._out: Optional[JsonlAppender] = None
        old = self._recorded()
        if old != fingerprint:
            gone = [f for f in (self.path, *map(Path, stale)) if f.exists()]
            if gone:
                logging.getLogger(__name__).warning("%s: made with other settings: discarding %s", self.path,
                                                    ", ".join(map(str, gone)))
            for f in gone:
                f.unlink()
        if sidecar is not None:
            write_json_atomic(sidecar, {"fingerprint": fingerprint, **(record or {})})
        elif not self.path.exists():
            self.append([{"id": self.HEADER_ID, "fingerprint": fingerprint}])

    def _recorded(self):
        """The fingerprint the log was made under (None: none recorded)."""
        if self.sidecar is not None:
            try:
                return read_json(self.sidecar, default={}).get("fingerprint")
            except (DeepSpecError, AttributeError):
                return None
        if not self.path.exists():
            return None
        with open(self.path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        try:
            head = json.loads(first)
        except ValueError:
            return None
        return head.get("fingerprint") if isinstance(head, dict) and head.get("id") == self.HEADER_ID else None

    def ids(self) -> set[str]:
        """The ids of the finished records (a torn last line cut off)."""
        return recover_jsonl(self.path) - {self.HEADER_ID}

    def records(self, what: str = "progress") -> dict[str, dict]:
        """id -> finished record (a torn last line cut off)."""
        recover_jsonl(self.path)
        if not self.path.exists():
            return {}
        return {r["id"]: r for _, _, r in iter_jsonl(self.path, what) if r.get("id") != self.HEADER_ID}

    def open(self) -> "ResumableLog":
        """Open the log for appending (created if missing)."""
        if self._out is None:
            self._out = JsonlAppender(self.path)
        return self

    def append(self, recs: list[dict]) -> None:
        self.open()._out.write(recs)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def finish(self, final: Optional[Path] = None) -> None:
        """Close; the log becomes `final` (its output) or, without one, is removed."""
        self.close()
        if final is not None:
            os.replace(self.path, final)
        else:
            self.path.unlink(missing_ok=True)


# flock's errors on a filesystem without file locks (Lustre mounted without flock, some NFS)
NO_FILE_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, busy: Optional[str] = None, remove: bool = False,
              unlocked: str = "going on without one") -> Iterator[None]:
    """Hold an exclusive flock on `path` (created with its folder). `busy` None:
    wait for it; else stop at once with the one-line DeepSpecError `busy` when
    another process holds it. `remove`: delete the lock file on the way out, while
    still holding it (a process that opened the removed file takes the new one).
    Where the filesystem has no file locks: no lock, a warning ending in `unlocked`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy is not None else 0))
        except BlockingIOError:
            f.close()
            raise DeepSpecError(f"{busy} (lock {path})") from None
        except OSError as e:
            f.close()
            if e.errno not in NO_FILE_LOCKS:
                raise
            logging.getLogger(__name__).warning("%s: no file locks on this filesystem (%s); %s",
                                                path, e.strerror, unlocked)
            yield
            return
        if not remove:
            break
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break  # else the holder removed it as we opened it: take the new one
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        if remove:
            with contextlib.suppress(OSError):
                path.unlink()  # while still holding it (see the inode check above)
        f.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover

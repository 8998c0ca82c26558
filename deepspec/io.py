"""Small I/O helpers: atomic writes and one-line user errors."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


class DeepSpecError(Exception):
    """A user-facing error: printed as one line by the CLI, no traceback."""


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
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike, missing: str = "") -> Any:
    """The JSON value stored in `path`; a missing file (message `missing`) or
    malformed JSON is a one-line DeepSpecError."""
    path = Path(path)
    if not path.exists():
        raise DeepSpecError(missing or f"file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DeepSpecError(f"{path}: malformed JSON ({e.msg})") from None


def iter_jsonl(path: str | os.PathLike, what: str = "file", hint: str = ""):
    """(line number, "file:line", record) for every non-blank line of a JSONL
    file; a missing file or a malformed line is a one-line DeepSpecError."""
    path = Path(path)
    if not path.exists():
        raise DeepSpecError(f"{what} not found: {path}{hint}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DeepSpecError(f"{where}: malformed JSON ({e.msg})") from None
            yield lineno, where, rec


def require_file(path: str | os.PathLike, what: str = "file") -> Path:
    p = Path(path)
    if not p.exists():
        raise DeepSpecError(f"{what} not found: {p}")
    return p

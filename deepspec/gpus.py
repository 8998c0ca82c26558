"""GPU jobs on one machine (`claim-gpus`, the rules' `gpu_env`): Snakemake hands
out no GPU ids locally, so every GPU rule (regeneration server, cache, training,
evaluation) runs `python -m deepspec claim-gpus N -- <command>`, which takes N
free ids of the machine (or of the ids CUDA_VISIBLE_DEVICES already lists, e.g.
SLURM's) under flock in a lock directory shared by the jobs of the machine (or of
the SLURM allocation), sets CUDA_VISIBLE_DEVICES to them and replaces itself with
the command, which keeps the locks until it exits. A job that finds too few free
ids waits.
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .errors import DeepSpecError
from .files import file_lock

log = logging.getLogger(__name__)


def gpu_env(n: int) -> str:
    """The prefix a GPU rule puts before its command: `claim-gpus n` (nothing for n = 0)."""
    return f"python -m deepspec claim-gpus {int(n)} -- " if n > 0 else ""



def machine_gpus() -> list[str]:
    """The GPU ids of this machine: nvidia-smi's (the devices this process can
    open), else /proc/driver/nvidia/gpus; none on a machine without NVIDIA GPUs."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return [x.strip() for x in r.stdout.split() if x.strip().isdigit()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(proc.iterdir())))] if proc.is_dir() else []



def gpu_pool(env: Mapping[str, str]) -> tuple[list[str], Path]:
    """(the ids to choose from, the lock directory): CUDA_VISIBLE_DEVICES's ids when
    it is set (SLURM's allocation, or the user's choice), else the machine's; the
    lock directory is per machine and user, per allocation inside a SLURM job
    (whose ids are its own), or DEEPSPEC_GPU_LOCK_DIR."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else machine_gpus()
    if env.get("DEEPSPEC_GPU_LOCK_DIR"):
        lock_dir = Path(env["DEEPSPEC_GPU_LOCK_DIR"])
    else:
        job = f"-slurm{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else ""
        lock_dir = Path("/tmp") / f"deepspec-gpu-locks-{os.getuid()}{job}"
    return ids, lock_dir



def _lock_name(gpu_id: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) + ".lock"



def try_claim(ids: Sequence[str], n: int, lock_dir: Path) -> Optional[tuple[list[str], list[int]]]:
    """(n ids, their locked file descriptors) when n of `ids` are free, else None
    (nothing held). All or nothing, under a directory-wide lock, so two jobs never
    hold part of what each needs."""
    with file_lock(lock_dir / "claim.lock"):
        got: list[tuple[str, int]] = []
        for gpu_id in ids:
            fd = os.open(lock_dir / _lock_name(gpu_id), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            got.append((gpu_id, fd))
            if len(got) == n:
                return [g for g, _ in got], [fd for _, fd in got]
        for _, fd in got:
            os.close(fd)
        return None



# claim-gpus' default bound on waiting ($DEEPSPEC_CLAIM_TIMEOUT_S; 0 = none). Run as the docs say
# (--resources gpu=<the machine's GPUs>), a GPU job never waits for another job of its own run, so
# a long wait means GPUs held from outside it (an orphaned server, another run): say so, by whom.
CLAIM_TIMEOUT_S = 4 * 3600.0



def claim_timeout_s(env: Mapping[str, str]) -> Optional[float]:
    """How long claim-gpus waits for free GPUs: $DEEPSPEC_CLAIM_TIMEOUT_S seconds
    (0 = without bound), default CLAIM_TIMEOUT_S."""
    raw = env.get("DEEPSPEC_CLAIM_TIMEOUT_S", "").strip()
    if not raw:
        return CLAIM_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        raise DeepSpecError(f"DEEPSPEC_CLAIM_TIMEOUT_S={raw!r}: a number of seconds (0 = no bound)") from None
    if not t >= 0 or t == float("inf"):
        raise DeepSpecError(f"DEEPSPEC_CLAIM_TIMEOUT_S={raw!r}: a number of seconds (0 = no bound)")
    return t or None



def lock_holders(ids: Sequence[str], lock_dir: Path) -> list[str]:
    """"pid N (command)" of the processes that took the GPU locks of `ids` and
    still run (from /proc/locks; empty where it does not exist)."""
    inodes = {}
    for gpu_id in ids:
        try:
            inodes[os.stat(lock_dir / _lock_name(gpu_id)).st_ino] = gpu_id
        except OSError:
            pass
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = set()
    for line in lines:
        f = line.split()
        if len(f) > 5 and f[1] == "FLOCK" and f[4].isdigit():
            try:
                if int(f[5].rsplit(":", 1)[1]) in inodes:
                    pids.add(int(f[4]))
            except (ValueError, IndexError):
                pass
    out = []
    for pid in sorted(pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone (its children may still hold the lock)
        out.append(f"pid {pid} ({cmd[:80]})")
    return out



def claim_gpus(ids: Sequence[str], n: int, lock_dir: Path, poll_s: float = 5.0,
               timeout_s: Optional[float] = None) -> tuple[list[str], list[int]]:
    """Wait until n of `ids` are free and hold them (`try_claim`); the locks last
    as long as the returned descriptors stay open (across exec). A wait longer
    than timeout_s (None: no bound) is a one-line error naming the holders."""
    if n > len(ids):
        raise DeepSpecError(f"claim-gpus: the job needs {n} GPUs, but only {len(ids)} are visible "
                            f"({','.join(ids) or 'none'}); lower the rule's GPU count or use a larger machine")
    t0, said = time.monotonic(), False
    while True:
        got = try_claim(ids, n, lock_dir)
        if got is not None:
            return got
        if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
            holders = lock_holders(ids, lock_dir)
            raise DeepSpecError(f"claim-gpus: no {n} free GPUs of {','.join(ids)} within {timeout_s:g} s (locks in "
                                f"{lock_dir}{'; held by ' + ', '.join(holders) if holders else ''}): stop what holds "
                                "them, or wait longer with DEEPSPEC_CLAIM_TIMEOUT_S (0 = no bound)")
        if not said:
            holders = lock_holders(ids, lock_dir)
            log.info("claim-gpus: waiting for %d free GPUs of %s (locks in %s%s; at most %s)", n, ",".join(ids), lock_dir,
                     "; held by " + ", ".join(holders) if holders else "",
                     f"{timeout_s:g} s" if timeout_s is not None else "without bound")
            said = True
        time.sleep(poll_s)



def cli_claim_gpus(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec claim-gpus",
                                description="run a command on N GPUs of this machine that no other job holds")
    p.add_argument("n", type=int, help="GPUs the command needs")
    p.add_argument("--timeout-s", type=float, help="wait at most this long for free GPUs (default "
                   "$DEEPSPEC_CLAIM_TIMEOUT_S, else 4 h; 0 = no bound)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the command")
    a = p.parse_args(argv)
    cmd = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not cmd:
        raise DeepSpecError("claim-gpus: no command after --")
    ids, lock_dir = gpu_pool(os.environ)
    if a.n > 0 and ids:
        timeout = claim_timeout_s(os.environ) if a.timeout_s is None else (a.timeout_s or None)
        claimed, fds = claim_gpus(ids, a.n, lock_dir, timeout_s=timeout)
        for fd in fds:
            os.set_inheritable(fd, True)  # the command holds the locks until it exits
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
        log.info("claim-gpus: CUDA_VISIBLE_DEVICES=%s", os.environ["CUDA_VISIBLE_DEVICES"])
    elif a.n > 0:
        log.warning("claim-gpus: no GPU visible on this machine; running without CUDA_VISIBLE_DEVICES")
    os.execvp(cmd[0], cmd)
    return 0  # pragma: no cover - execvp does not return

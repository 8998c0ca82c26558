"""How the train rule starts `deepspec train`: one process; `accelerate launch`
on one machine with more than one GPU; torch's launcher (torchrun) for more
than one CPU process (accelerate's own CPU launcher needs mpirun; under
torchrun's environment accelerate's PartialState joins a gloo process group);
or one `accelerate launch` per node of a SLURM allocation. `deepspec train`
run by hand starts its processes the same way (`direct_command`).

Multi-node: the rule runs `srun --nodes N --ntasks-per-node 1 python -m
deepspec launch-node ...` inside the job's allocation; on every node
`launch-node` reads its rank and the main node's address from SLURM's
environment (SLURM_NNODES, SLURM_NODEID, SLURM_LAUNCH_NODE_IPADDR, else the
first host of SLURM_JOB_NODELIST) and replaces itself with
`accelerate launch --multi_gpu --num_machines N --machine_rank R
--num_processes N*G --main_process_ip ADDR --main_process_port PORT -m deepspec
train ...`. Training then sees N*G processes; the trainer's data order and
anchor seeds do not depend on how many there are. The inner srun takes
`--overlap`: it runs inside the job step the SLURM executor already started,
which holds the allocation's CPUs and memory.

GPU jobs on one machine (`claim-gpus`, the rules' `gpu_env`): Snakemake hands
out no GPU ids locally, so every GPU rule runs `python -m deepspec claim-gpus N
-- <command>`, which takes N free ids of the machine (or of the ids
CUDA_VISIBLE_DEVICES already lists, e.g. SLURM's) under flock in a lock
directory shared by the jobs of the machine (or of the SLURM allocation), sets
CUDA_VISIBLE_DEVICES to them and replaces itself with the command, which keeps
the locks until it exits. A job that finds too few free ids waits.
"""
from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..errors import DeepSpecError

log = logging.getLogger(__name__)


def launcher(train_cfg: dict, port: str | int | None = None, cpus: int | None = None) -> str:
    """The command prefix the train rule puts before `-m deepspec train ...`
    (without the CUDA_VISIBLE_DEVICES prefix, which the rule adds). `port` is
    the rendezvous port (default train.main_process_port; the rule passes
    each method its own, so that parallel trainers on one machine do not
    collide: train_port in workflow/rules/common.smk). `cpus`: the CPUs of each
    node's task with train.nodes > 1 (the rule's threads, resources.train.threads).

    The inner srun names its task count and CPUs: run inside the executor's job
    step (`srun -n1 --cpus-per-task=T`), it would otherwise inherit that step's
    SLURM_NTASKS=1 and SLURM_CPUS_PER_TASK, and Slurm may then start one task on
    one node instead of one per node."""
    gpus, procs, nodes = int(train_cfg["gpus"]), int(train_cfg["processes"]), int(train_cfg["nodes"])
    port = train_cfg["main_process_port"] if port is None else port
    if nodes > 1:
        if gpus < 1:
            raise DeepSpecError("train.nodes > 1 needs train.gpus (GPUs per node) >= 1")
        per_task = f"--cpus-per-task {int(cpus)} " if cpus else ""
        return (f"srun --overlap --nodes {nodes} --ntasks {nodes} --ntasks-per-node 1 {per_task}"
                f"--gpus-per-node {gpus} python -m deepspec launch-node --gpus-per-node {gpus} --port {port} --")
    if gpus > 1:
        return f"accelerate launch --multi_gpu --num_processes {gpus} --num_machines 1 --main_process_port {port}"
    if gpus == 0 and procs > 1:
        return f"python -m torch.distributed.run --nproc_per_node {procs} --master_port {port}"
    return "python"


def free_port() -> int:
    """A free TCP port on this machine (the rendezvous of processes started by hand)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHED = ("WORLD_SIZE", "LOCAL_RANK")  # set by torchrun and accelerate launch in every process they start


def direct_command(train_cfg: dict, env: Mapping[str, str], args: Sequence[str], port: int) -> list[str] | None:
    """`deepspec train` run by hand (not under a launcher): the command that
    starts its processes as the train rule would (train.gpus > 1, or
    train.processes > 1 on CPU), with `args` after `-m deepspec train`; None
    for one process or when already launched. train.nodes > 1 needs a SLURM
    allocation: one line saying how to run it."""
    import sys

    if any(env.get(k) for k in LAUNCHED):
        return None
    prefix = launcher(train_cfg, port)
    if prefix == "python":
        return None
    tail = ["-m", "deepspec", "train", *args]
    if int(train_cfg["nodes"]) > 1:
        raise DeepSpecError(f"train.nodes {train_cfg['nodes']} > 1 runs inside a SLURM allocation: run the Snakemake "
                            f"train rule, or in the allocation `{prefix} {shlex.join(tail)}`")
    return [sys.executable if w == "python" else w for w in shlex.split(prefix)] + tail


def _main_address(env: Mapping[str, str]) -> str:
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise DeepSpecError("launch-node: not inside a SLURM allocation (no SLURM_JOB_NODELIST)")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return hosts.stdout.split()[0]


def node_command(env: Mapping[str, str], gpus_per_node: int, port: int, args: Sequence[str]) -> list[str]:
    """The accelerate command of this node; `args` are what follows it (-m deepspec train ...)."""
    try:
        nodes, rank = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    except (KeyError, ValueError):
        raise DeepSpecError("launch-node: SLURM_NNODES / SLURM_NODEID not set (run it through srun)") from None
    return ["accelerate", "launch", "--multi_gpu", "--num_machines", str(nodes), "--machine_rank", str(rank),
            "--num_processes", str(nodes * gpus_per_node), "--main_process_ip", _main_address(env),
            "--main_process_port", str(port), *args]


def cli_launch_node(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec launch-node", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the module to run, e.g. -- -m deepspec train --preset ...")
    a = p.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cmd = node_command(os.environ, a.gpus_per_node, a.port, args)
    print("launch-node:", shlex.join(cmd), flush=True)
    os.execvp(cmd[0], cmd)
    return 0  # pragma: no cover - execvp does not return


# --------------------------------------------------------------------------- GPU ids of one machine


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
    lock_dir.mkdir(parents=True, exist_ok=True)
    guard = os.open(lock_dir / "claim.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
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
    finally:
        os.close(guard)  # closing releases the guard's lock


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

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
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
from typing import Mapping, Sequence

from ..errors import DeepSpecError
from ..settings import Train

log = logging.getLogger(__name__)


def launcher(train: Train | Mapping, port: str | int | None = None, cpus: int | None = None) -> str:
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
    t = Train.view(train)
    gpus, procs, nodes = t.gpus, t.processes, t.nodes
    port = t.main_process_port if port is None else port
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


def direct_command(train: Train | Mapping, env: Mapping[str, str], args: Sequence[str], port: int) -> list[str] | None:
    """`deepspec train` run by hand (not under a launcher): the command that
    starts its processes as the train rule would (train.gpus > 1, or
    train.processes > 1 on CPU), with `args` after `-m deepspec train`; None
    for one process or when already launched. train.nodes > 1 needs a SLURM
    allocation: one line saying how to run it."""
    import sys

    if any(env.get(k) for k in LAUNCHED):
        return None
    t = Train.view(train)
    prefix = launcher(t, port)
    if prefix == "python":
        return None
    tail = ["-m", "deepspec", "train", *args]
    if t.nodes > 1:
        raise DeepSpecError(f"train.nodes {t.nodes} > 1 runs inside a SLURM allocation: run the Snakemake "
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

"""Distributed training proven on CPU (gloo): two processes started the way
the train rule starts them (`launch.launcher`, torchrun on CPU) on the tiny
target in online mode follow the same
trajectory as one process at the same global batch, and a checkpoint resumes
under either world size. Also the multi-node launch commands."""
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config import load_config
from deepspec.training import run as T
from deepspec.training.checkpoints import TRAINER_STATE
from deepspec.training.launch import direct_command, free_port, launcher, node_command

from helpers import write_conversations

STEPS = 4
TOL = dict(rtol=1e-4, atol=1e-5)  # gradients are summed in another order across processes


def _argv(tmp_path, tiny_cfg, out):
    sets = [f"resources_dir={tiny_cfg['resources_dir']}", f"data.root={tiny_cfg['data']['root']}",
            f"results_dir={tmp_path / 'results'}", "cache.mode=online", "train.global_batch=4",
            "train.micro_batch=1", f"train.epochs={STEPS}", f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.log_every=1",
            "train.precision=float32"]  # fp32: bf16 autocast would round the two worlds' partial sums apart (~1e-3)
    return ["--preset", "tiny", "--method", "dspark", "--out", str(out), *[x for kv in sets for x in ("--set", kv)]]


def _two_processes(argv):
    prefix = launcher(dict(load_config("tiny")["train"], gpus=0, processes=2, nodes=1), port=free_port())
    cmd = [sys.executable if w == "python" else w for w in shlex.split(prefix)] + ["-m", "deepspec", "train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stderr


def _losses(out):
    with open(out / "train_log.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _weights(out):
    return load_file(str(out / "model.safetensors"))


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_cfg, tiny_target):
    """One process and two processes, same settings, to the end."""
    tmp = tmp_path_factory.mktemp("dist")
    write_conversations(tmp / "results" / "tiny" / "regen" / "conversations.jsonl")
    one, two = tmp / "one", tmp / "two"
    assert T.cli_train(_argv(tmp, tiny_cfg, one)) == 0
    _two_processes(_argv(tmp, tiny_cfg, two))
    return tmp, one, two


def test_two_processes_follow_the_one_process_trajectory(runs):
    _, one, two = runs
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == STEPS
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), **TOL)
    _close(_weights(two), _weights(one))
    assert sorted(p.name for p in (two / "checkpoints" / "step_2").glob("rng_*.pt")) == ["rng_0.pt", "rng_1.pt"]


@pytest.mark.parametrize("saved_under", [2, 1])
def test_resume_under_the_other_world_size(runs, tiny_cfg, saved_under):
    """A checkpoint saved under 2 processes resumes under 1, and one saved
    under 1 resumes under 2, and both continue the same trajectory."""
    tmp, one, two = runs
    out = tmp / f"resumed_from_{saved_under}"
    shutil.copytree(two if saved_under == 2 else one, out)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS}")  # as if killed after the checkpoint at step 2
    (out / "config.json").unlink()
    if saved_under == 2:
        assert T.cli_train(_argv(tmp, tiny_cfg, out)) == 0
    else:
        assert "resumed from" in _two_processes(_argv(tmp, tiny_cfg, out))
    torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(_losses(one)), **TOL)
    _close(_weights(out), _weights(one))


def test_train_run_by_hand_starts_its_processes(runs, tiny_cfg, monkeypatch):
    """`python -m deepspec train --set train.processes=2` (not through the rule)
    trains in two processes: the same trajectory as the rule's launch."""
    tmp, one, two = runs
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp / "by_hand"
    assert T.cli_train(_argv(tmp, tiny_cfg, out) + ["--set", "train.processes=2"]) == 0
    state = json.loads((out / "checkpoints" / "step_2" / TRAINER_STATE).read_text())
    assert state["world_size"] == 2
    torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(_losses(two)), **TOL)
    _close(_weights(out), _weights(two))


def test_direct_commands():
    base = dict(load_config("tiny")["train"], gpus=0, processes=1, nodes=1, main_process_port=29500)
    args = ["--preset", "tiny", "--method", "dspark"]
    assert direct_command(base, {}, args, 123) is None
    assert direct_command(dict(base, processes=2), {}, args, 123) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "123",
        "-m", "deepspec", "train", *args]
    assert direct_command(dict(base, processes=2), {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, args, 123) is None
    assert direct_command(dict(base, gpus=8), {}, args, 123)[:4] == ["accelerate", "launch", "--multi_gpu",
                                                                     "--num_processes"]
    with pytest.raises(T.DeepSpecError, match="inside a SLURM allocation: run the Snakemake train rule") as e:
        direct_command(dict(base, gpus=8, nodes=2), {}, args, 123)
    assert "\n" not in str(e.value) and "srun --overlap --nodes 2" in str(e.value)


def test_launchers():
    base = dict(load_config("tiny")["train"], gpus=0, processes=1, nodes=1, main_process_port=29500)
    assert launcher(base) == "python"
    assert launcher(dict(base, processes=2)) == "python -m torch.distributed.run --nproc_per_node 2 --master_port 29500"
    assert launcher(dict(base, gpus=8, processes=4)).startswith("accelerate launch --multi_gpu --num_processes 8 ")
    two_nodes = launcher(dict(base, gpus=8, nodes=2), port=29600, cpus=32)
    # --overlap: the step runs inside the executor's own job step (which holds the
    # allocation's CPUs and memory); --gpus-per-node: each node's own 8 GPUs; the task
    # count and the CPUs named (not inherited from the executor's one-task step, NR11)
    assert two_nodes == ("srun --overlap --nodes 2 --ntasks 2 --ntasks-per-node 1 --cpus-per-task 32 "
                         "--gpus-per-node 8 python -m deepspec launch-node --gpus-per-node 8 --port 29600 --")


def test_multi_node_command_from_slurm_environment():
    """2 nodes x 8 GPUs, as node 1 of the allocation sees it (no cluster needed)."""
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    cmd = node_command(env, 8, 29600, ["-m", "deepspec", "train", "--preset", "qwen3-4b", "--method", "dspark"])
    assert cmd == ["accelerate", "launch", "--multi_gpu", "--num_machines", "2", "--machine_rank", "1",
                   "--num_processes", "16", "--main_process_ip", "10.0.0.7", "--main_process_port", "29600",
                   "-m", "deepspec", "train", "--preset", "qwen3-4b", "--method", "dspark"]
    with pytest.raises(T.DeepSpecError, match="SLURM_NNODES"):
        node_command({}, 8, 29600, [])


def test_sharded_optimizer_takes_the_same_steps_and_resumes_under_one_process(runs, tiny_cfg):
    """train.shard_optimizer: two processes, each holding the AdamW moments of its
    share of the parameters, end with the weights of the unsharded two-process run;
    its checkpoint holds the whole optimizer state, which one process resumes."""
    tmp, one, two = runs
    zero = tmp / "zero"
    _two_processes(_argv(tmp, tiny_cfg, zero) + ["--set", "train.shard_optimizer=true"])
    a, b = _weights(zero), _weights(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    full = torch.load(two / "checkpoints" / "step_2" / "optimizer.pt", weights_only=False)
    sharded = torch.load(zero / "checkpoints" / "step_2" / "optimizer.pt", weights_only=False)
    assert sorted(sharded["state"]) == sorted(full["state"])
    for i in full["state"]:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sharded["state"][i][k], full["state"][i][k]), (i, k)
    out = tmp / "zero_resumed"
    shutil.copytree(zero, out)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS}")
    (out / "config.json").unlink()
    assert T.cli_train(_argv(tmp, tiny_cfg, out) + ["--set", "train.shard_optimizer=true"]) == 0  # one process
    _close(_weights(out), _weights(one))
    out2 = tmp / "zero_resumed_sharded"  # and two sharded processes load the whole state back
    shutil.copytree(zero, out2)
    shutil.rmtree(out2 / "checkpoints" / f"step_{STEPS}")
    (out2 / "config.json").unlink()
    assert "resumed from" in _two_processes(_argv(tmp, tiny_cfg, out2) + ["--set", "train.shard_optimizer=true"])
    a = _weights(out2)
    assert all(torch.equal(a[k], b[k]) for k in b)

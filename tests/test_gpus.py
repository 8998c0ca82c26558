"""GPU ids of one machine (`claim-gpus`, deepspec/gpus.py): every GPU
job gets ids no other job holds. Only lock files are involved, so this runs on CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec import gpus as G
from deepspec.errors import DeepSpecError

REPO = Path(__file__).resolve().parents[1]


def _close(fds):
    for fd in fds:
        os.close(fd)


def test_claims_are_disjoint_and_released(tmp_path):
    ids = ["0", "1", "2"]
    a, fa = G.try_claim(ids, 1, tmp_path)
    b, fb = G.try_claim(ids, 2, tmp_path)
    assert a == ["0"] and b == ["1", "2"]
    assert G.try_claim(ids, 1, tmp_path) is None  # all held: nothing is taken
    _close(fb)
    c, fc = G.try_claim(ids, 2, tmp_path)
    assert c == ["1", "2"]
    # all or nothing: 2 are asked for while only 0 is free -> none is held afterwards
    _close(fc)
    held = G.try_claim(ids, 2, tmp_path)[1]
    assert G.try_claim(ids, 2, tmp_path) is None
    _close(fa)
    assert G.try_claim(ids, 1, tmp_path)[0] == ["0"]
    _close(held)


def test_claim_waits_then_fails_in_one_line(tmp_path):
    ids, fds = G.try_claim(["0"], 1, tmp_path)
    with pytest.raises(DeepSpecError, match="no 1 free GPUs of 0 within"):
        G.claim_gpus(["0"], 1, tmp_path, poll_s=0.01, timeout_s=0.05)
    with pytest.raises(DeepSpecError, match="needs 2 GPUs, but only 1 are visible"):
        G.claim_gpus(["0"], 2, tmp_path)
    _close(fds)


def test_pool_and_lock_dir_from_the_environment(tmp_path):
    ids, d = G.gpu_pool({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_JOB_ID": "77"})
    assert ids == ["2", "3"] and d.name.endswith("-slurm77")  # SLURM: its ids, a lock dir per allocation
    ids, d = G.gpu_pool({"CUDA_VISIBLE_DEVICES": "1", "DEEPSPEC_GPU_LOCK_DIR": str(tmp_path)})
    assert ids == ["1"] and d == tmp_path
    assert G.gpu_env(0) == "" and G.gpu_env(2) == "python -m deepspec claim-gpus 2 -- "


def _run_claim(env, n, code):
    return subprocess.Popen([sys.executable, "-m", "deepspec", "claim-gpus", str(n), "--", sys.executable, "-c", code],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def test_cli_sets_cuda_visible_devices_and_the_command_holds_the_lock(tmp_path):
    """The command sees its own ids; while it runs (after exec) another job gets the others."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5", DEEPSPEC_GPU_LOCK_DIR=str(tmp_path),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flag = tmp_path / "go"
    hold = ("import os, sys, time\nprint(os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
            f"while not os.path.exists({str(flag)!r}): time.sleep(0.02)\n")
    first = _run_claim(env, 1, hold)
    assert first.stdout.readline().strip() == "4"
    second = _run_claim(env, 1, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert second.communicate(timeout=60)[0].strip() == "5"
    flag.touch()
    assert first.wait(timeout=60) == 0
    third = _run_claim(env, 2, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert third.communicate(timeout=60)[0].strip() == "4,5"  # both free again once the holder exited


def test_cli_waits_a_bounded_time_and_names_the_holder(tmp_path):
    """NR8: GPUs held by something that never lets go (e.g. an orphaned vLLM
    engine) make claim-gpus fail in one line naming the holder, after
    $DEEPSPEC_CLAIM_TIMEOUT_S, instead of waiting forever."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", DEEPSPEC_GPU_LOCK_DIR=str(tmp_path), DEEPSPEC_CLAIM_TIMEOUT_S="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = _run_claim(env, 1, "import sys, time\nprint('held', flush=True)\ntime.sleep(120)")
    waiter = None
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = _run_claim(env, 1, "print('ran')")
        out, err = waiter.communicate(timeout=60)
        errors = [l for l in err.splitlines() if "error" in l]
        assert waiter.returncode == 2 and "ran" not in out and len(errors) == 1, err
        assert "no 1 free GPUs of 0 within 1 s" in errors[0] and f"held by pid {holder.pid}" in errors[0], errors[0]
        assert G.claim_timeout_s({}) == G.CLAIM_TIMEOUT_S and G.claim_timeout_s({"DEEPSPEC_CLAIM_TIMEOUT_S": "0"}) is None
        with pytest.raises(DeepSpecError, match="DEEPSPEC_CLAIM_TIMEOUT_S"):
            G.claim_timeout_s({"DEEPSPEC_CLAIM_TIMEOUT_S": "soon"})
    finally:
        for p in (holder, waiter):
            if p is not None:
                p.kill()
                p.wait()


def test_machine_gpus_from_nvidia_smi(monkeypatch):
    """Without CUDA_VISIBLE_DEVICES the pool is the machine's GPUs (nvidia-smi's indices)."""
    class R:
        returncode, stdout = 0, "0\n1\n2\n"

    monkeypatch.setattr(G.subprocess, "run", lambda *a, **k: R())
    assert G.gpu_pool({})[0] == ["0", "1", "2"]
    monkeypatch.setattr(G.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("nvidia-smi")))
    monkeypatch.setattr(G, "Path", lambda p: type("P", (), {"is_dir": lambda self: False})() if "nvidia" in str(p) else Path(p))
    assert G.gpu_pool({})[0] == []

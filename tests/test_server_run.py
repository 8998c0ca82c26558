"""The regeneration server of one workflow run (deepspec/regeneration/supervisor.py, deepspec/regeneration/server_status.py,
`python -m deepspec run-server`) and the shards' side of it: a stale or foreign
server on the port is never used (R2/R5, NR14), a server that cannot start or
dies fails the shards at once (R3, NR5, N1), and the server's whole process
group goes when the run ends or fails (NR8). Fake servers only (a few lines of
http.server, or a bare TCP listener): every test stops what it starts."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepspec.errors import DeepSpecError
from deepspec.regeneration.server_status import own_server_gone, read_status, wait_for_own_server
from deepspec.regeneration.supervisor import fill_command, group_listens

REPO = Path(__file__).resolve().parents[1]

# An OpenAI-ish server: GET /v1/models answers; its model name is argv[2], its /version argv[3].
FAKE = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/version" and len(sys.argv) > 3:  # vLLM's version endpoint
            b = json.dumps({"version": sys.argv[3]}).encode()
        else:
            b = json.dumps({"object": "list", "data": [{"id": sys.argv[2]}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE)
    return path


@pytest.fixture
def procs():
    """Processes a test starts (each in a group of its own): all killed, groups included, at the end."""
    started = []
    yield started
    for p in started:
        for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), p.kill):
            try:
                kill()
            except OSError:
                pass
        p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO))


def _supervise(procs, status, token, command, *, port="auto", grace="3", env=None, extra=()):
    p = subprocess.Popen([sys.executable, "-m", "deepspec", "run-server", "--status", str(status), "--token", token,
                          "--port", str(port), "--grace-s", grace, *extra, command],
                         env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    procs.append(p)
    return p


def _wait_gone(pids, timeout=15.0):
    end = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < end:
        left = [p for p in left if _alive(p)]
        time.sleep(0.1)
    return left


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_state(status, token, states, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = read_status(status)
        if st and st.get("token") == token and st.get("state") in states:
            return st
        time.sleep(0.1)
    raise AssertionError(f"{status}: no state in {states} within {timeout} s: {read_status(status)}")


def test_fill_command_leaves_the_port_for_run_time():
    t = 'serve {model} --port {port} --name {name} --json {{"a": 1}}'
    cmd = fill_command(t, model="m{x}", host="h", name="n", port=None)
    assert cmd.format(port=5) == fill_command(t, model="m{x}", host="h", name="n", port=5) == \
        'serve m{x} --port 5 --name n --json {"a": 1}'
    with pytest.raises(KeyError):
        fill_command("serve {modl}", model="m", host="h", name="n", port=None)


def test_a_busy_port_fails_the_run_and_its_shards_at_once(tmp_path, procs, fake):
    """R2 / R3 / NR14: a stale server of the same name on the port (and a silent
    TCP listener) are refused before our server starts; the shard, waiting with
    the run's token, fails in one line at once instead of talking to it or
    waiting health_timeout_s."""
    stale_port = _free_port()
    procs.append(subprocess.Popen([sys.executable, str(fake), str(stale_port), "tiny-qwen3"], start_new_session=True))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", stale_port)) == 0:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for port in (stale_port, silent.getsockname()[1]):
            status = tmp_path / f"server{port}.json"
            t0 = time.monotonic()
            sup = _supervise(procs, status, "run1", f"{sys.executable} {fake} {{port}} tiny-qwen3", port=port)
            with pytest.raises(DeepSpecError, match=f"port {port} on 127.0.0.1 is already in use"):
                wait_for_own_server(status, "run1", 1800)
            out, _ = sup.communicate(timeout=30)
            lines = [l for l in out.splitlines() if "error" in l]
            assert sup.returncode == 2 and len(lines) == 1 and f"port {port}" in lines[0], out
            assert time.monotonic() - t0 < 20 and read_status(status)["state"] == "failed"
    finally:
        silent.close()


def test_the_shard_talks_only_to_its_own_runs_server(tmp_path, procs, fake):
    """R2/R5: a status left by another run (another token, its server still
    answering) is not the shard's; its own server, on a port chosen at run time,
    is found by its token and only reported ready once its own process group
    holds the port and answers."""
    status = tmp_path / "server.json"
    stale_port = _free_port()
    procs.append(subprocess.Popen([sys.executable, str(fake), str(stale_port), "x"], start_new_session=True))
    status.write_text(json.dumps({"token": "old", "host": socket.gethostname(), "pid": procs[0].pid,
                                  "url_host": "127.0.0.1", "port": stale_port, "state": "ready"}))
    with pytest.raises(DeepSpecError, match="no regeneration server of this run reported .* within 1 s .only another run's"):
        wait_for_own_server(status, "new", 1800, poll_s=0.1, status_wait_s=1)
    sup = _supervise(procs, status, "new", f"{sys.executable} {fake} {{port}} x")
    url = wait_for_own_server(status, "new", 60, poll_s=0.1)
    st = read_status(status)
    assert st["state"] == "ready" and url == f"http://127.0.0.1:{st['port']}/v1" and st["port"] != stale_port
    assert group_listens(st["pgid"], st["port"]) and not group_listens(st["pgid"], stale_port)
    assert own_server_gone(status, "new") is None and "another run's" in own_server_gone(status, "old")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0 and read_status(status)["state"] == "stopped"
    assert "stopped by SIGTERM" in own_server_gone(status, "new") and not _wait_gone([st["server_pid"]])


def test_a_vllm_server_of_an_untested_series_is_stopped_in_one_line(tmp_path, procs, fake, monkeypatch):
    """vLLM versions as data: run-server --engine vllm reads the served /version once the
    server answers; the tested series is recorded in the status, another one fails the run
    (and its shards) in one line naming the tested series, the server stopped."""
    from deepspec.vllm_env import VLLM_VERSION

    ok, bad = tmp_path / "ok.json", tmp_path / "bad.json"
    sup = _supervise(procs, ok, "t1", f"{sys.executable} {fake} {{port}} x {VLLM_VERSION}.1", extra=("--engine", "vllm"))
    st = _wait_state(ok, "t1", ("ready",))
    assert st["engine_version"] == f"{VLLM_VERSION}.1"
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    env = {k: v for k, v in _env().items() if k != "DEEPSPEC_ALLOW_UNTESTED_VLLM"}
    sup = _supervise(procs, bad, "t2", f"{sys.executable} {fake} {{port}} x 0.34.0", extra=("--engine", "vllm"), env=env)
    with pytest.raises(DeepSpecError, match=f"vLLM 0.34.0 .* is untested: .* tested with vLLM {VLLM_VERSION}.x"):
        wait_for_own_server(bad, "t2", 60, poll_s=0.1)
    out, _ = sup.communicate(timeout=30)
    st = read_status(bad)
    assert sup.returncode == 2 and st["state"] == "failed" and "untested" in st["message"]
    assert not _wait_gone([st["server_pid"]])


@pytest.mark.parametrize("case", ["exits", "killed", "no-program", "vllm"])
def test_a_server_that_cannot_start_fails_the_shard_in_seconds(tmp_path, procs, case, monkeypatch):
    """R3b / NR5 / N1: a server that exits at start-up (bad model path), whose
    supervisor is SIGKILLed before it is ready, whose program does not exist, or
    `vllm serve` without vLLM: the waiting shard fails in one line within
    seconds, not after health_timeout_s (1800 s)."""
    status = tmp_path / "server.json"
    command = {"exits": f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}",
               "killed": "sleep 600 {port}",
               "no-program": "/nonexistent/serve --port {port}",
               "vllm": "vllm serve /some/model --port {port}"}[case]
    env = {}
    if case == "vllm":  # an environment without vLLM, as the README's install gives
        env = dict(PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin", DEEPSPEC_VLLM_PYTHON="")
        if any(Path(d, "vllm").exists() for d in env["PATH"].split(":")):
            pytest.skip("vllm is installed here")
    t0 = time.monotonic()
    sup = _supervise(procs, status, "tok", command, env={**_env(), **env})
    if case == "killed":
        end = time.monotonic() + 30
        while "server_pid" not in (st := read_status(status) or {}):
            assert time.monotonic() < end
            time.sleep(0.1)
        os.kill(sup.pid, signal.SIGKILL)
    says = {"exits": "exited with code 3 before it was ready", "killed": "died before it was ready",
            "no-program": "program '/nonexistent/serve' is not found", "vllm": "vLLM is not installed here"}[case]
    with pytest.raises(DeepSpecError, match=says):
        wait_for_own_server(status, "tok", 1800, poll_s=0.1)
    assert time.monotonic() - t0 < 30
    out = sup.communicate(timeout=30)[0]
    if case != "killed":
        errors = [l for l in out.splitlines() if "error" in l]
        assert sup.returncode == 2 and len(errors) == 1 and says in errors[0], out
    else:  # the watchdog stopped the server (sleep) after its supervisor's SIGKILL
        assert not _wait_gone([st["server_pid"]]), "the server outlived its killed supervisor"


def test_the_servers_process_group_goes_as_a_whole(tmp_path, procs, fake):
    """NR8 / R5: a server that forks (as vLLM forks its API servers and engines,
    one of them ignoring SIGTERM) is stopped as a whole group when Snakemake
    terminates it, when its supervisor is SIGKILLed (a failed shard), and when
    the snakemake that started it is SIGKILLed (the stale-server cause)."""
    stubborn = f"{sys.executable} -c 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'"
    command = f"{sys.executable} {fake} {{port}} x & {stubborn} & wait"

    def group(st):
        return [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == st["pgid"]]

    for how in ("SIGTERM", "SIGKILL", "parent SIGKILL"):
        status = tmp_path / f"{how.replace(' ', '_')}.json"
        if how == "parent SIGKILL":  # run-server under a parent (snakemake) that is SIGKILLed
            parent = subprocess.Popen(
                [sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:]).wait()",
                 sys.executable, "-m", "deepspec", "run-server", "--status", str(status), "--token", "t",
                 "--grace-s", "1", command], env=_env(), start_new_session=True)
            procs.append(parent)
        else:
            sup = _supervise(procs, status, "t", command, grace="1")
        st = _wait_state(status, "t", ["ready"])
        members = group(st)
        assert len(members) >= 3, members  # the shell, the server, the stubborn child
        if how == "SIGTERM":
            sup.send_signal(signal.SIGTERM)
            assert sup.wait(timeout=30) == 0
        elif how == "SIGKILL":
            sup.kill()
        else:
            parent.kill()
        assert not _wait_gone(members + [st["pid"]]), f"{how}: left running"
        if how != "SIGKILL":
            assert _wait_state(status, "t", ["stopped"])["message"] in ("stopped by SIGTERM",
                                                                        "stopped: the snakemake that started it is gone")


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# A chat server that answers `argv[2]` requests, then exits with code 3 (a crash mid-run).
DYING = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
left = int(sys.argv[2])
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        b = b'{"object": "list", "data": [{"id": "tiny"}]}'
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_POST(self):
        global left
        if left == 0:
            os._exit(3)
        left -= 1
        self.rfile.read(int(self.headers["Content-Length"]))
        b = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"completion_tokens": 1}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_shard_stops_at_once_when_its_server_dies_mid_run(tiny_cfg, tiny_target, tmp_path, procs):
    """The shard's whole server path: it finds its run's server through the
    status (a port chosen at run time), regenerates from it, and when the server
    crashes it stops in one line naming why (exit code 3), keeping what was done,
    instead of waiting connect_timeout_s; without the run's token it refuses to
    start at all."""
    import copy

    from deepspec.data.prompts import Prompt
    from deepspec.paths import RunPaths
    from deepspec.regeneration.regenerate import regenerate

    cfg = copy.deepcopy(tiny_cfg)
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["regenerate"].update(backend="server", concurrency=1, max_retries=1, retry_backoff_s=0.1, connect_timeout_s=60,
                             server={"command": "unused", "gpus": 0, "port": None, "host": None,
                                     "health_timeout_s": 1800, "threads": 1, "mem_mb": 1000})
    script = tmp_path / "dying.py"
    script.write_text(DYING)
    status = RunPaths.of(cfg).server_status()
    prompts = [Prompt(id=f"d:{i}", turns=[f"Question {i}?"], source="d") for i in range(8)]
    out = tmp_path / "c.jsonl"
    with pytest.raises(DeepSpecError, match="talks only to the server its workflow run starts"):
        regenerate(cfg, out, prompts=prompts, target=tiny_target)
    sup = _supervise(procs, status, "run7", f"{sys.executable} {script} {{port}} 3")
    t0 = time.monotonic()
    with pytest.raises(DeepSpecError, match=r"server of this run stopped serving \(failed: the regeneration server "
                                            r"exited with code 3 while serving"):
        regenerate(cfg, out, prompts=prompts, target=tiny_target, server_token="run7")
    assert time.monotonic() - t0 < 30 and sup.wait(timeout=30) == 2
    assert len((tmp_path / "c.jsonl.partial").read_text().splitlines()) == 3


def test_the_server_holds_its_gpus_until_its_group_is_gone(tmp_path, procs, fake):
    """run-server claims the server's GPUs (claim-gpus' locks) and hands the locks
    to the server's process group: held while it serves, free once it stopped."""
    from deepspec.gpus import try_claim

    locks = tmp_path / "locks"
    env = {**_env(), "CUDA_VISIBLE_DEVICES": "3,4", "DEEPSPEC_GPU_LOCK_DIR": str(locks), "DEEPSPEC_CLAIM_TIMEOUT_S": "5"}
    seen = tmp_path / "cuda.txt"
    command = (f"{sys.executable} -c 'import os; open(\"{seen}\", \"w\").write(os.environ[\"CUDA_VISIBLE_DEVICES\"])'; "
               f"exec {sys.executable} {fake} {{port}} x")
    status = tmp_path / "server.json"
    p = subprocess.Popen([sys.executable, "-m", "deepspec", "run-server", "--status", str(status), "--token", "g",
                          "--gpus", "2", command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    procs.append(p)
    _wait_state(status, "g", ["ready"])
    assert seen.read_text() == "3,4" and try_claim(["3", "4"], 1, locks) is None  # both held by the server
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    ids, fds = try_claim(["3", "4"], 2, locks)
    for fd in fds:
        os.close(fd)
    assert ids == ["3", "4"]

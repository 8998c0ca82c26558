"""`python -m deepspec run-server`: the regeneration server of one workflow run,
supervised (workflow/rules/regenerate.smk, rule regenerate_server); the
shards' side of it is deepspec/regeneration/server_status.py.

The shards must talk only to the server their run started: never to a stale
one left on the port by an earlier run (a SIGKILLed snakemake), nor to another
user's server on a shared port, nor wait half an hour for a server that died at
start-up. So the rule runs the server's command line under this supervisor:

  * it writes a status file (regen/server.json: the run's token, this host,
    its pid, the port, the state and, when it stops, why) before anything else,
    atomically, and rewrites it on every change of state;
  * it checks the command's program exists (a `vllm serve` without vLLM fails
    at once, in one line), takes the port given (refusing it in one line when
    something already listens there) or, for regenerate.server.port null, a
    free port chosen now, and claims the server's GPUs itself
    (`gpus.claim_gpus`, a bounded wait; the locks pass to the server);
  * it starts the command in a process group of its own (setsid) and calls the
    server ready only when the port's listening socket belongs to a process of
    that group (/proc/net/tcp and /proc/<pid>/fd: the port is checked, not just
    that *a* server answers) and GET /v1/models answers;
  * it stops the whole group (SIGTERM, then SIGKILL after `grace_s`) when
    Snakemake terminates it (the shards are done), when the server exits on its
    own (state failed, with the exit code), or when the snakemake that started
    it is gone (its parent pid changes). A SIGKILL of the supervisor itself
    (Snakemake kills every job of a failed group that way) is covered by a
    watchdog process of its own session that holds the other end of a pipe:
    when the supervisor dies the pipe closes and the watchdog stops the group,
    so vLLM's forked API servers and engines never outlive the run holding GPUs.

The plan gives every run a token (regenerate.smk, REGEN_TOKEN) passed to the
supervisor and to each shard (`regenerate --server-token`). A shard waits for
a status carrying its token; it fails in one line as soon as that status says
failed or stopped, or its supervisor process is gone, and it only ever sends
requests to the port of a server reported ready. A status of another run (a
stale file) is not its own: it waits for its own for at most STATUS_WAIT_S.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from ..errors import DeepSpecError
from ..files import write_json_atomic
from .server_status import server_url

log = logging.getLogger(__name__)

GRACE_S = 30.0  # SIGTERM -> SIGKILL of the server's process group
SHELL_WORDS = {"exec", "cd", "source", ".", "set", "export", "ulimit", "umask", "{", "(", "if", "for", "while", "nohup", "time"}


# ---------------------------------------------------------------- the command


def fill_command(template: str, *, model: str, host: str, name: str, port: Optional[int]) -> str:
    """The server's command line: `template` with {model}, {host}, {name} and
    {port} filled in (str.format: KeyError / ValueError for what it cannot
    fill). With port None (chosen at run time) {port} stays for the supervisor
    and every other brace comes out doubled, so that its ``.format(port=...)``
    gives the text the template meant."""
    values = {"model": model, "host": host, "name": name}
    if port is not None:
        return template.format(port=port, **values)
    out = []
    for literal, field, spec, _conv in string.Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        if field == "port":
            out.append("{port}")
            continue
        text = format(values[field] if field in values else {}[field], spec or "")
        out.append(text.replace("{", "{{").replace("}", "}}"))
    return "".join(out)


def check_command(command: str) -> None:
    """A one-line DeepSpecError when the command's program does not exist (before
    anything is started): for `vllm`, how to install it (N1)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return  # the shell will say what is wrong
    words = [w for w in words if not ("=" in w and w.split("=", 1)[0].isidentifier())]  # VAR=value prefixes
    if words[:1] == ["env"]:
        words = words[1:]
    if not words:
        raise DeepSpecError("the regeneration server's command is empty")
    prog = words[0]
    if prog in SHELL_WORDS or any(c in prog for c in "$`;|&<>()"):
        return  # shell syntax: the shell runs it and says what is wrong
    if shutil.which(prog) or ("/" in prog and os.access(prog, os.X_OK)):
        return
    if os.path.basename(prog) == "vllm":
        from ..vllm_env import vllm_python
        vllm_python()  # raises the one-line "vLLM is not installed here: ..." when it is not found
        raise DeepSpecError("vLLM is installed beside this environment, but `vllm` is not on PATH: replan (snakemake "
                            "runs it as `<its python> -m vllm.entrypoints.cli.main`) or put its bin/ on PATH")
    raise DeepSpecError(f"the regeneration server's program {prog!r} is not found (regenerate.server.command)")


# ---------------------------------------------------------------- the port


def _addr(host: str) -> str:
    return socket.gethostbyname(host) if host not in ("", "0.0.0.0") else "0.0.0.0"


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port, or the port cannot be bound there
    (a server on 0.0.0.0 holds every address's port)."""
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((_addr(host) if host not in ("", "0.0.0.0") else "127.0.0.1", port)) == 0:
            return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no obstacle
        try:
            s.bind((_addr(host), port))
        except OSError:
            return True
    return False


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((_addr(host), 0))
        return s.getsockname()[1]


def listening_inodes(port: int) -> Optional[set[int]]:
    """The socket inodes listening on `port` (any address, IPv4 or IPv6); None
    where /proc/net/tcp does not exist (not Linux)."""
    found, seen_table = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen_table = True
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(f[9]))
    return found if seen_table else None


def group_pids(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def group_listens(pgid: int, port: int) -> Optional[bool]:
    """Whether a process of group `pgid` holds a socket listening on `port`;
    None where that cannot be known (no /proc)."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    want = {f"socket:[{i}]" for i in inodes}
    for pid in group_pids(pgid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    return True
            except OSError:
                pass
    return False


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, which an init that
    does not reap may keep, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    for pid in group_pids(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            return True
    return False


# ---------------------------------------------------------------- the watchdog

# Runs in a session of its own, its stdin the read end of a pipe only the
# supervisor writes to; when the supervisor is gone (even by SIGKILL) the read
# returns and it stops the server's process group.
_WATCHDOG = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
sys.stdin.buffer.read()
def alive():
    try:
        os.killpg(pgid, 0)
    except OSError:  # none left (or only another user's: not ours to stop)
        return False
    if not os.path.isdir("/proc/self"):
        return True
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.getpgid(int(d)) == pgid:
                with open(f"/proc/{d}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        return True
        except OSError:
            pass
    return False
if alive():
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        pass
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.2)
    if alive():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
"""


def _start_watchdog(pgid: int, grace_s: float) -> int:
    """Start the watchdog of group `pgid`; returns the write end of its pipe
    (close it, or die, and the watchdog stops the group)."""
    r, w = os.pipe()
    subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(pgid), str(grace_s)], stdin=r,
                     stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    os.close(r)
    return w


# ---------------------------------------------------------------- the supervisor


class _Stop(Exception):
    """SIGTERM / SIGINT / SIGHUP before the server started."""


class Supervisor:
    def __init__(self, status: Path, token: str, host: str, log_path: Optional[str]):
        self.status, self.token, self.host = Path(status), token, host
        self.fields = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "url_host": host,
                       "port": None, "log": log_path, "state": "starting", "message": ""}
        self.stop_reason: Optional[str] = None
        self.started = False

    def write(self, **kw) -> None:
        self.fields.update(kw)
        write_json_atomic(self.status, self.fields)

    def _on_signal(self, signum, _frame) -> None:
        self.stop_reason = f"stopped by {signal.Signals(signum).name}"
        if not self.started:
            raise _Stop(self.stop_reason)


def _stop_group(proc: subprocess.Popen, pgid: int, grace_s: float) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after grace_s;
    returns once no process of the group is left."""
    if proc.poll() is None or _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        proc.poll()
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < end:
            proc.poll()
            time.sleep(0.1)
    proc.wait()


def _claim_gpus(env: dict, gpus: int, claim_timeout_s: Optional[float]) -> list[int]:
    """Claim `gpus` GPUs of this machine for the server (gpus.claim_gpus, a bounded
    wait), setting CUDA_VISIBLE_DEVICES in `env`; the lock fds the server inherits."""
    from ..gpus import claim_gpus, gpu_pool
    from ..gpus import claim_timeout_s as default_timeout

    ids, lock_dir = gpu_pool(env)
    if not ids:
        log.warning("no GPU visible on this machine; the server runs without CUDA_VISIBLE_DEVICES")
        return []
    timeout = claim_timeout_s if claim_timeout_s is not None else default_timeout(os.environ)
    claimed, fds = claim_gpus(ids, gpus, lock_dir, timeout_s=timeout)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
    log.info("claimed GPUs %s", env["CUDA_VISIBLE_DEVICES"])
    return fds


def served_version(host: str, port: int, timeout: float = 5.0) -> Optional[str]:
    """The version a server reports at GET /version (vLLM's OpenAI server), or None."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/version", timeout=timeout) as r:
            v = json.loads(r.read().decode()).get("version")
            return str(v) if v else None
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None


def _untested_engine(engine: Optional[str], host: str, port: int, command: str, sup) -> Optional[str]:
    """engine="vllm": the served version (GET /version) recorded in the status; the
    one-line refusal of an untested series (`vllm_env.check_vllm_version`), or None."""
    if engine != "vllm":
        return None
    from ..vllm_env import check_vllm_version

    version = served_version(host, port)
    try:
        check_vllm_version(version or "unknown", f"the regeneration server, {command.split()[0]}")
    except DeepSpecError as e:
        return str(e)
    sup.write(engine_version=version)
    return None


def run_server(command: str, *, status: str | os.PathLike, token: str, host: str = "127.0.0.1",
               port: Optional[int] = None, gpus: int = 0, log_path: Optional[str] = None,
               grace_s: float = GRACE_S, poll_s: float = 0.2, claim_timeout_s: Optional[float] = None,
               engine: Optional[str] = None) -> int:
    """Run the regeneration server `command` until Snakemake stops it (see the
    module docstring); 0 when stopped, a one-line DeepSpecError when it could not
    start or exited on its own. `command` has {port} still to fill when `port`
    is None. engine="vllm": once ready, the server's /version is recorded in the
    status and an untested vLLM series stops it (`vllm_env.check_vllm_version`)."""
    sup = Supervisor(Path(status), token, host, log_path)
    sup.write()  # first of all: the shards know this run's server exists
    old = {s: signal.signal(s, sup._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    fds: list[int] = []
    try:
        try:
            check_command(command if port is not None else command.format(port=0))
            if port is None:
                port = free_port(host)
                command = command.format(port=port)
            elif port_in_use(host, port):
                raise DeepSpecError(f"port {port} on {host} is already in use (another server, maybe one an earlier run "
                                    "left): stop it, or set regenerate.server.port to a free port or to null (chosen "
                                    "at run time)")
            sup.write(port=port)
            env = dict(os.environ)
            fds = _claim_gpus(env, gpus, claim_timeout_s) if gpus > 0 else []
        except _Stop as e:
            sup.write(state="stopped", message=str(e))
            return 0
        except DeepSpecError as e:
            sup.write(state="failed", message=str(e))
            raise
        log.info("starting the regeneration server on port %d: %s", port, command)
        sup.started = True
        proc = subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True, pass_fds=fds)
        for fd in fds:
            os.close(fd)  # the server holds the GPU locks now (and its forked children with it)
        pgid = proc.pid
        watch = _start_watchdog(pgid, grace_s)
        sup.write(server_pid=proc.pid, pgid=pgid)
        parent = os.getppid()
        ready, failure = False, None
        try:
            while sup.stop_reason is None:
                rc = proc.poll()
                if rc is not None:
                    failure = (f"the regeneration server exited with code {rc} "
                               f"{'while serving' if ready else 'before it was ready'}" + (f" (its output: {log_path})" if log_path else ""))
                    break
                if os.getppid() != parent:
                    sup.stop_reason = "stopped: the snakemake that started it is gone"
                    break
                if not ready:
                    mine = group_listens(pgid, port)
                    if mine is not False and _answers(server_url(host, port) + "/models"):
                        failure = _untested_engine(engine, host, port, command, sup)
                        if failure:
                            break
                        ready = True
                        sup.write(state="ready")
                        log.info("the regeneration server is ready at %s%s", server_url(host, port),
                                 "" if mine else " (its port's owner not checked: no /proc)")
                time.sleep(poll_s)
        finally:
            _stop_group(proc, pgid, grace_s)
            os.close(watch)
        if failure:
            sup.write(state="failed", message=failure)
            raise DeepSpecError(failure)
        sup.write(state="stopped", message=sup.stop_reason)
        log.info("%s; the server's process group is gone", sup.stop_reason)
        return 0
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for s, h in old.items():
            signal.signal(s, h)



def cli_run_server(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec run-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--status", required=True, help="the status file the shards read (regen/server.json)")
    p.add_argument("--token", required=True, help="this run's token (the shards' --server-token)")
    p.add_argument("--host", default="127.0.0.1", help="the address the shards use")
    p.add_argument("--port", default="auto", help="the port, or auto: a free one chosen now ({port} in COMMAND)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to claim for the server (claim-gpus)")
    p.add_argument("--log", help="the server's log (named in errors)")
    p.add_argument("--grace-s", type=float, default=GRACE_S, help="SIGTERM -> SIGKILL of the server's process group")
    p.add_argument("--engine", choices=["vllm"], default=None,
                   help="vllm: check the served vLLM's version (GET /version) against the tested series")
    p.add_argument("command", help="the server's command line (one word: quote it)")
    a = p.parse_args(argv)
    if a.port == "auto":
        port = None
    else:
        try:
            port = int(a.port)
        except ValueError:
            raise DeepSpecError(f"--port {a.port!r}: a port number or auto") from None
    return run_server(a.command, status=a.status, token=a.token, host=a.host, port=port, gpus=a.gpus,
                      log_path=a.log, grace_s=a.grace_s, engine=a.engine)

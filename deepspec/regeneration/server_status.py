"""The shards' side of the regeneration server of one workflow run: the status
file its supervisor (`deepspec run-server`, deepspec/regeneration/supervisor.py)
writes, read by the shards (`wait_for_own_server`, `own_server_gone`) so that
they talk only to the server their run started and fail in one line, at once,
when it failed, stopped or is gone. A status of another run (a stale file) is
not its own: a shard waits for its own for at most STATUS_WAIT_S.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..errors import DeepSpecError

log = logging.getLogger(__name__)

STATUS_WAIT_S = 120.0  # how long a shard waits for its run's server to report at all
FINAL = ("failed", "stopped")


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the pid
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def server_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/v1"


def read_status(path: str | os.PathLike) -> Optional[dict]:
    try:
        st = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def _gone(st: dict) -> bool:
    """The supervisor of status `st` is known to be gone (same host, no process)."""
    return st.get("host") == socket.gethostname() and isinstance(st.get("pid"), int) and not _pid_alive(st["pid"])


def own_server_gone(path: str | os.PathLike, token: str) -> Optional[str]:
    """Why this run's server (status `path`, `token`) is no longer serving, or None."""
    st = read_status(path)
    if st is None or st.get("token") != token:
        return f"its status {path} is gone or is another run's"
    if st.get("state") in FINAL:
        return f"{st['state']}: {st.get('message') or 'no reason given'}"
    if _gone(st):
        return f"its supervisor (pid {st['pid']}) is gone" + (f"; see {st['log']}" if st.get("log") else "")
    return None


def wait_for_own_server(path: str | os.PathLike, token: str, timeout_s: float, *, poll_s: float = 0.5,
                        status_wait_s: float = STATUS_WAIT_S) -> str:
    """The base URL (http://host:port/v1) of the server this run started, once
    its supervisor reports it ready under `token`; a one-line DeepSpecError as
    soon as it failed, stopped or is gone, when no status of this run appears
    within status_wait_s, or when it is not ready within timeout_s."""
    t0 = time.monotonic()
    while True:
        st = read_status(path)
        waited = time.monotonic() - t0
        if st is not None and st.get("token") == token:
            state = st.get("state")
            if state == "ready":
                if _gone(st):
                    raise DeepSpecError(f"the regeneration server of this run is gone (supervisor pid {st['pid']}, {path})")
                log.info("this run's regeneration server is ready after %.1f s", waited)
                return server_url(st.get("url_host") or "127.0.0.1", int(st["port"]))
            if state in FINAL:
                raise DeepSpecError(f"the regeneration server of this run {state}: {st.get('message') or 'no reason given'}")
            if _gone(st):
                raise DeepSpecError(f"the regeneration server of this run died before it was ready (supervisor pid "
                                    f"{st['pid']})" + (f"; see {st['log']}" if st.get("log") else ""))
        elif waited > min(status_wait_s, timeout_s):
            why = "none" if st is None else "only another run's"
            raise DeepSpecError(f"no regeneration server of this run reported in {path} within "
                                f"{min(status_wait_s, timeout_s):g} s ({why}): its service job did not start")
        if waited > timeout_s:
            raise DeepSpecError(f"the regeneration server of this run was not ready within {timeout_s:g} s "
                                f"(regenerate.server.health_timeout_s)" + (f"; see {st['log']}" if st and st.get("log") else ""))
        time.sleep(poll_s)

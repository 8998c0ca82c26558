"""Regeneration's server backend: an OpenAI-compatible chat client (vLLM, or
`deepspec serve` on CPU) with bounded waits, retries of transient failures and
the prompt-length check (`regenerate.backend: server`)."""
from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Optional, Sequence

from ..data.conversations import with_system_prompt
from ..data.prompts import Prompt
from ..errors import DeepSpecError
from ..paths import RunPaths
from ..settings import Regenerate, Settings
from .sampling import record_seed

log = logging.getLogger(__name__)


# Errors worth another attempt: the server may come back, and a short or
# malformed body is not an answer. Other HTTP errors (4xx) are final.
RECORD_ERRORS = (urllib.error.URLError, OSError, ValueError, http.client.HTTPException)



def _transient(e: Exception) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500 or e.code in (408, 429)
    return isinstance(e, RECORD_ERRORS)



def _chat_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")



def server_urls(regen: Regenerate) -> list[str]:
    """The chat-completions URLs of regenerate.urls (servers already running;
    the server the workflow starts, regenerate.server, is found through its
    status instead: server_status.wait_for_own_server)."""
    return [_chat_url(u) for u in regen.urls]



def _models_url(chat_url: str) -> str:
    return chat_url[: -len("/chat/completions")] + "/models"



def wait_for_servers(urls: Sequence[str], timeout_s: float, *, poll_s: float = 1.0, gone=None) -> float:
    """Wait until every chat URL's server answers ``GET .../models`` (any HTTP
    answer but a 5xx counts: it is listening), at most `timeout_s` in all;
    returns the seconds waited. A server that never answers fails the job in
    one line naming its URL, instead of every record failing its retries.
    `gone()`, polled between tries, says why the server will never answer
    (e.g. its supervisor reported it failed): then fail at once."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    for url in urls:
        probe = _models_url(url)
        while True:
            left = deadline - time.monotonic()
            try:
                with urllib.request.urlopen(probe, timeout=max(0.1, min(5.0, left))):
                    break
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    break
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                why = str(getattr(e, "reason", e))
            why_gone = gone() if gone else None
            if why_gone:
                raise DeepSpecError(f"the regeneration server of this run stopped serving ({why_gone})")
            if time.monotonic() + poll_s > deadline:
                raise DeepSpecError(f"no OpenAI-compatible server answered at {probe} within {timeout_s:g} s ({why}): "
                                    "start one there or fix regenerate.urls / regenerate.server")
            time.sleep(poll_s)
    waited = time.monotonic() - t0
    log.info("%d server(s) up after %.1f s", len(urls), waited)
    return waited



def wait_for_exit(status_file: str | os.PathLike, timeout_s: float = 300.0, *, poll_s: float = 0.2) -> None:
    """Wait until the server supervisor named in `status_file` (its "host" and
    "pid", as `regeneration.supervisor.run_server` writes them) has exited, then remove the
    file. Snakemake only signals a service job; this makes the GPU jobs after
    the merge start once the server has let go of its GPUs (the supervisor
    exits only after its server's whole process group). A process on another
    host (a SLURM group job, whose end frees its GPUs) is not waited for."""
    import socket

    path = Path(status_file)
    if not path.exists():
        return
    try:
        st = json.loads(path.read_text())
        host, pid = st["host"], int(st["pid"])
    except (ValueError, KeyError, TypeError):
        raise DeepSpecError(f"{path}: not a regeneration server status (expected JSON with host and pid)") from None
    deadline = time.monotonic() + timeout_s
    while host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:  # a process of another user took the pid: ours is gone
            break
        if time.monotonic() > deadline:
            raise DeepSpecError(f"the regeneration server (pid {pid}, {path}) is still running {timeout_s:g} s after "
                                "its shards finished: stop it before the GPU jobs start")
        time.sleep(poll_s)
    path.unlink()



def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())



def _chat(url: str, body: dict, regen: Regenerate) -> tuple[str, bool, int]:
    """One chat completion: (text, cut at max_tokens, completion tokens), with
    retries and exponential backoff on transient errors."""
    for attempt in range(regen.max_retries + 1):
        try:
            resp = _post_json(url, body, regen.request_timeout_s)
            try:
                choice = resp["choices"][0]
                content = choice["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"unexpected response: {json.dumps(resp)[:200]}") from None
            if not isinstance(content, str):
                raise ValueError("response without text content")
            tokens = int((resp.get("usage") or {}).get("completion_tokens", 0))
            return content, choice.get("finish_reason") == "length", tokens
        except RECORD_ERRORS as e:
            if attempt == regen.max_retries or not _transient(e):
                raise
            wait = regen.retry_backoff_s * 2**attempt
            log.info("%s: %s; retrying in %.1f s (%d/%d)", url, _reason(e), wait, attempt + 1, regen.max_retries)
            time.sleep(wait)
    raise AssertionError("unreachable")



def _refused(e: Exception) -> bool:
    return isinstance(e, ConnectionRefusedError) or isinstance(getattr(e, "reason", None), ConnectionRefusedError)



def _reason(e: Exception) -> str:
    return f"HTTP {e.code}: {e.reason}" if isinstance(e, urllib.error.HTTPError) else f"{type(e).__name__}: {e}"



class TooLong(ValueError):
    """A record whose history is over data.max_prompt_tokens: skipped, not failed."""



def _answer_with_server(url: str, prompt: Prompt, s: Settings, history_tokens=None, limit: Optional[int] = None
                        ) -> tuple[list[dict], int]:
    regen, system = s.regenerate, s.data.system_prompt
    model = regen.model_name or s.target.spec
    msgs: list[dict] = []
    n = 0
    for turn, text in enumerate(prompt.turns):
        msgs.append({"role": "user", "content": text})
        if history_tokens is not None:
            k = history_tokens(msgs)
            if k > limit:
                raise TooLong(f"too long: the history of turn {turn} has {k} tokens, over data.max_prompt_tokens={limit}")
        body = {
            "model": model,
            "messages": with_system_prompt(msgs, system),
            "temperature": regen.temperature,
            "top_p": regen.top_p,
            "top_k": regen.top_k if regen.top_k > 0 else -1,
            "min_p": regen.min_p,
            "max_tokens": regen.max_new_tokens,
            "seed": record_seed(regen.seed, prompt.id, turn) & 0x7FFFFFFF,
            "n": 1,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        content, truncated, tokens = _chat(url, body, regen)
        n += tokens
        msg = {"role": "assistant", "content": content}
        msgs.append({**msg, "truncated": True} if truncated else msg)
    return msgs, n



def regenerate_server(s: Settings, prompts: list[Prompt], write, fail, bar, *, too_long, server_token=None, tokenizer=None
                      ) -> int:
    regen = s.regenerate
    own = None  # (status file, token) of the server this run started
    if regen.server:
        if not server_token:
            raise DeepSpecError("regenerate.server is set: this job talks only to the server its workflow run starts "
                                "(snakemake passes --server-token); to use a server of your own set "
                                "regenerate.server=null and regenerate.urls=[http://<host>:<port>/v1]")
        from .server_status import wait_for_own_server
        own = (RunPaths.of(s).server_status(), server_token)
        urls = [_chat_url(wait_for_own_server(*own, regen.server["health_timeout_s"]))]
    else:
        urls = server_urls(regen)
        if not urls:
            raise DeepSpecError("regenerate.backend is 'server' but neither regenerate.server nor regenerate.urls is set "
                                "(e.g. --set regenerate.urls=[http://localhost:30000])")
    wait_for_servers(urls, regen.connect_timeout_s)
    limit = s.data.max_prompt_tokens
    if tokenizer is None:
        from ..targets.loading import load_tokenizer
        tokenizer = load_tokenizer(s)

    from ..core.target import render_chat
    one_at_a_time = threading.Lock()  # a fast tokenizer is not to be called from many threads at once

    def history_tokens(msgs: list[dict]) -> int:
        with one_at_a_time:
            return len(render_chat(tokenizer, with_system_prompt(msgs, s.data.system_prompt), tokenize=True))

    n_tokens = 0
    with ThreadPoolExecutor(max_workers=regen.concurrency * len(urls)) as pool:
        futs = {pool.submit(_answer_with_server, urls[k % len(urls)], p, s, history_tokens, limit): (p, urls[k % len(urls)])
                for k, p in enumerate(prompts)}
        for fut in as_completed(futs):
            p, url = futs[fut]
            try:
                msgs, n = fut.result()
            except TooLong as e:
                too_long(p, str(e))
            except RECORD_ERRORS as e:
                if _refused(e):  # the server is gone (e.g. it crashed): stop in one line, not record by record
                    try:  # its supervisor may report the crash only a moment after the refusal: poll both
                        gone = None
                        if own:
                            from .server_status import own_server_gone
                            gone = lambda: own_server_gone(*own)  # noqa: E731
                        wait_for_servers([url], regen.connect_timeout_s, poll_s=0.5 if own else 1.0, gone=gone)
                    except DeepSpecError:
                        pool.shutdown(wait=False, cancel_futures=True)
                        raise
                fail(p, _reason(e))
            else:
                write([{"id": p.id, "source": p.source, "messages": msgs}])
                n_tokens += n
            bar.update(1)
            bar.set_postfix_str(f"{n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
    return n_tokens

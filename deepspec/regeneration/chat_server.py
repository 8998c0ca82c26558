"""`python -m deepspec serve`: a small OpenAI-compatible chat server over a
local target (any checkpoint `load_target` reads: a prepared target directory,
a builtin spec, a hub id).

It answers what regeneration's server backend sends (regenerate.py,
`_answer_with_server`): ``POST /v1/chat/completions`` with messages,
max_tokens, temperature, top_p, top_k (-1 = off), min_p, seed, n = 1 and
chat_template_kwargs.enable_thinking = false, and returns choices[0].message.content,
choices[0].finish_reason ("stop" or "length") and usage. ``GET /v1/models`` and
``GET /health`` answer as soon as it listens (the workflow's supervisor,
regeneration/supervisor.py, polls /v1/models before it reports the server ready).

Decoding is `sampling.generate_batch` (the local backend's sampler), one
request at a time, each drawn from its own ``torch.Generator`` seeded with the
request's ``seed`` (0 when absent), so the same request always gets the same
answer. This is the CPU stand-in for vLLM/SGLang that lets the workflow's
server rule (workflow/rules/regenerate.smk, regenerate.server) be tested end to
end; on GPUs the paper presets start vLLM instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import torch

from ..errors import DeepSpecError
from .sampling import Sampling

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 (the message says why)."""


def _number(body: dict, key: str, default, lo: float, hi: float, kind=float):
    v = body.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"'{key}' must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise BadRequest(f"'{key}' = {v} is outside [{lo}, {hi}]")
    return kind(v)


def sampling_of(body: dict, max_tokens_limit: int) -> tuple[list[dict], Sampling, int]:
    """(messages, sampling settings, seed) of a chat-completions body; BadRequest
    names the first thing wrong with it."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': text}}")
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is served")
    if body.get("stream"):
        raise BadRequest("streaming is not served")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or kwargs.get("enable_thinking", False):
        raise BadRequest("only chat_template_kwargs.enable_thinking = false is served (the non-thinking template)")
    top_k = _number(body, "top_k", -1, -1, 2**31 - 1, int)
    settings = Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=0 if top_k <= 0 else top_k,  # OpenAI/vLLM -1 (or 0) = no top-k; generate_batch: 0
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        max_new_tokens=_number(body, "max_tokens", max_tokens_limit, 1, max_tokens_limit, int),
    )
    if settings.top_p <= 0:
        raise BadRequest("'top_p' must be > 0")
    seed = _number(body, "seed", 0, -(2**63), 2**63 - 1, int)
    return [{"role": m["role"], "content": m["content"]} for m in msgs], settings, seed


class ChatServer:
    """The model, its name and the lock that serialises decoding."""

    def __init__(self, target, name: str, max_tokens: int):
        self.target, self.name, self.max_tokens = target, name, max_tokens
        self.lock = threading.Lock()
        self.served = 0

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "deepspec"}]}

    def complete(self, body: dict) -> dict:
        from .sampling import generate_batch

        msgs, settings, seed = sampling_of(body, self.max_tokens)
        model = body.get("model")
        if model is not None and model != self.name:
            raise BadRequest(f"model {model!r} is not served here (this server: {self.name!r})")
        t = self.target
        try:
            ids = t.chat_ids(msgs)
        except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
            raise BadRequest(f"the chat template refuses these messages: {e}") from None
        gen = torch.Generator().manual_seed(seed)
        with self.lock:
            out = generate_batch(t.model, [ids], [gen], settings, eos_ids=t.eos_token_ids, pad_id=t.tokenizer.pad_token_id)[0]
            self.served += 1
        stopped = bool(out) and out[-1] in t.eos_token_ids
        toks = [x for x in out if x not in t.eos_token_ids]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": t.tokenizer.decode(toks, skip_special_tokens=True)},
                         "finish_reason": "stop" if stopped else "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)},
        }


def make_handler(server: ChatServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj, ensure_ascii=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str) -> None:
            self._send(code, {"error": {"message": msg, "type": "invalid_request_error" if code == 400 else "server_error",
                                        "code": code}})

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            if path == "/health":
                self._send(200, {"status": "ok"})
            elif path in ("/v1/models", "/models"):
                self._send(200, server.models())
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            path = self.path.split("?")[0].rstrip("/")
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if path not in ("/v1/chat/completions", "/chat/completions"):
                return self._error(404, f"no such endpoint: POST {self.path}")
            try:
                body = json.loads(raw)
            except ValueError as e:
                return self._error(400, f"the body is not JSON: {e}")
            try:
                self._send(200, server.complete(body))
            except BadRequest as e:
                self._error(400, str(e))
            except Exception as e:  # a server-side failure: 500, and the server keeps serving
                log.exception("request failed")
                self._error(500, f"{type(e).__name__}: {e}")

        def log_message(self, fmt, *args):
            log.info("%s %s", self.address_string(), fmt % args)

    return Handler


def serve(target, *, host: str, port: int, name: str, max_tokens: int,
          ready: Optional[threading.Event] = None) -> ThreadingHTTPServer:
    """Start serving `target` at http://host:port (returns the running server;
    `shutdown()` stops it). The server thread is a daemon."""
    chat = ChatServer(target, name, max_tokens)
    try:
        httpd = ThreadingHTTPServer((host, port), make_handler(chat))
    except OSError as e:
        raise DeepSpecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    httpd.daemon_threads = True
    httpd.chat = chat
    threading.Thread(target=httpd.serve_forever, name="deepspec-serve", daemon=True).start()
    if ready is not None:
        ready.set()
    return httpd


def cli_serve(argv) -> int:
    from ..targets.loading import load_target

    p = argparse.ArgumentParser(prog="deepspec serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a prepared target directory, a builtin spec (tiny, smollm2-135m) or a hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", help="the model name requests give (default: MODEL as given)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask for")
    args = p.parse_args(argv)
    from pathlib import Path

    path = Path(args.model)
    target = load_target(args.model, path=path if (path / "config.json").exists() else None, dtype=args.dtype, device=args.device)
    stop = threading.Event()
    # SIGTERM (Snakemake ending the service job) and SIGINT stop serving and exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    httpd = serve(target, host=args.host, port=args.port, name=args.served_model_name or args.model, max_tokens=args.max_tokens)
    log.info("serving %s as %r at http://%s:%d/v1", args.model, httpd.chat.name, args.host, args.port)
    stop.wait()
    httpd.shutdown()
    httpd.server_close()
    log.info("stopped after %d requests", httpd.chat.served)
    return 0

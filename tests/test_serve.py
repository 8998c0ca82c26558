"""`deepspec serve` (deepspec/regeneration/chat_server.py) and the server side of
regeneration: the consumers' health wait, a refused URL failing in one line,
and the wait for the server's exit before the GPU jobs."""
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from deepspec.data.prompts import Prompt
from deepspec.errors import DeepSpecError
from deepspec.regeneration.chat_server import serve
from deepspec.regeneration.client import _answer_with_server, _chat_url, server_urls, wait_for_exit, wait_for_servers
from deepspec.regeneration.sampling import Sampling, generate_batch, record_seed
from deepspec.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tiny_target):
    httpd = serve(tiny_target, host="127.0.0.1", port=0, name="tiny", max_tokens=64)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_serve_answers_what_regeneration_sends(served, tiny_cfg, tiny_target):
    """The body regenerate's server backend sends gets the answer the local
    sampler draws from the request's seed (so a request always gets the same
    answer), with finish_reason and usage; /health and /v1/models answer."""
    url, httpd = served
    assert _get(url + "/health") == {"status": "ok"}
    assert [m["id"] for m in _get(url + "/v1/models")["data"]] == ["tiny"]
    s = Settings.of({**tiny_cfg, "regenerate": {**tiny_cfg["regenerate"], "model_name": "tiny", "max_new_tokens": 12}})
    prompt = Prompt(id="p:1", turns=["Name a colour.", "And another one?"], source="p")
    msgs, n = _answer_with_server(_chat_url(url + "/v1"), prompt, s)
    again, _ = _answer_with_server(_chat_url(url + "/v1"), prompt, s)
    assert msgs == again and httpd.chat.served == 4 and n > 0
    # turn 0 equals generate_batch under the seed regenerate sent (record_seed & 0x7FFFFFFF)
    ids = tiny_target.chat_ids([{"role": "user", "content": prompt.turns[0]}])
    gen = torch.Generator().manual_seed(record_seed(s.regenerate.seed, prompt.id, 0) & 0x7FFFFFFF)
    out = generate_batch(tiny_target.model, [ids], [gen], Sampling.of(s.regenerate), eos_ids=tiny_target.eos_token_ids,
                         pad_id=tiny_target.tokenizer.pad_token_id)[0]
    text = tiny_target.tokenizer.decode([t for t in out if t not in tiny_target.eos_token_ids], skip_special_tokens=True)
    assert msgs[1]["content"] == text and msgs[1].get("truncated", False) == (out[-1] not in tiny_target.eos_token_ids)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "seed": 7, "temperature": 1.0}
    r1, r2 = _post(url + "/v1/chat/completions", body), _post(url + "/v1/chat/completions", {**body, "seed": 8})
    assert r1["usage"]["completion_tokens"] <= 5 and r1["choices"][0]["finish_reason"] in ("stop", "length")
    assert r1["choices"][0]["message"]["content"] == _post(url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert r2["usage"]["prompt_tokens"] == r1["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, says", [
    ({"messages": []}, "'messages'"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": True}}, "enable_thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "'max_tokens'"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, "not served here"),
])
def test_serve_refuses_bad_requests_with_400(served, body, says):
    url, _ = served
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url + "/v1/chat/completions", body)
    assert e.value.code == 400 and says in json.loads(e.value.read())["error"]["message"]


def test_consumers_wait_for_a_server_that_comes_up_late(tiny_cfg, tiny_target):
    port = _free_port()
    started = []

    def later():
        time.sleep(1.5)
        started.append(serve(tiny_target, host="127.0.0.1", port=port, name="tiny", max_tokens=8))

    threading.Thread(target=later, daemon=True).start()
    urls = server_urls(dataclasses.replace(Settings.of(tiny_cfg).regenerate, urls=[f"http://127.0.0.1:{port}/v1"]))
    assert urls == [f"http://127.0.0.1:{port}/v1/chat/completions"]
    try:
        assert wait_for_servers(urls, 30, poll_s=0.2) >= 1.0
    finally:
        for h in started:
            h.shutdown()
            h.server_close()


def test_waiting_for_a_refusing_server_stops_once_it_is_known_gone():
    """A refused connection may come a moment before the supervisor reports its
    server failed: the wait polls `gone` and stops at once when it says why,
    not after the whole connect timeout (the race CI once lost)."""
    calls = []

    def gone():
        calls.append(1)
        return "failed: exited with code 3" if len(calls) >= 3 else None

    url = f"http://127.0.0.1:{_free_port()}/v1/chat/completions"
    t0 = time.monotonic()
    with pytest.raises(DeepSpecError, match=r"stopped serving \(failed: exited with code 3\)"):
        wait_for_servers([url], 60, poll_s=0.1, gone=gone)
    assert time.monotonic() - t0 < 10 and len(calls) == 3


def test_refused_urls_fail_within_a_minute_in_one_line(tmp_path):
    """Nothing listening at regenerate.urls: the job fails in one line naming the
    URL (connect_timeout_s, default 30 s), not after retrying every record."""
    from deepspec.config import load_config

    assert load_config("tiny", {})["regenerate"]["connect_timeout_s"] < 60
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), DEEPSPEC_DATA=str(REPO.parent / "shared" / "data"))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deepspec", "regenerate", "--preset", "tiny",
                        "--set", f"resources_dir={tmp_path}", "--set", f"results_dir={tmp_path}",
                        "--set", "regenerate.backend=server", "--set", f"regenerate.urls=[\"http://127.0.0.1:{port}/v1\"]",
                        "--set", "regenerate.connect_timeout_s=3", "--limit", "2", "--out", str(tmp_path / "c.jsonl")],
                       capture_output=True, text=True, env=env, timeout=120)
    wall = time.monotonic() - t0
    err = [l for l in r.stderr.splitlines() if "error" in l.lower()]
    assert r.returncode == 2 and wall < 60, (wall, r.stderr[-1000:])
    assert len(err) == 1 and f"http://127.0.0.1:{port}/v1/models" in err[0] and "within 3 s" in err[0], r.stderr[-1000:]
    assert not (tmp_path / "c.jsonl").exists()


def test_wait_for_exit_waits_for_the_server_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it as Snakemake does
    pid_file = tmp_path / "server.json"
    pid_file.write_text(json.dumps({"host": socket.gethostname(), "pid": proc.pid, "token": "t", "state": "stopped"}))
    t0 = time.monotonic()
    wait_for_exit(pid_file, 30)
    assert time.monotonic() - t0 >= 0.5 and proc.poll() is not None and not pid_file.exists()
    # still running after the timeout: one line naming the pid
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pid_file.write_text(json.dumps({"host": socket.gethostname(), "pid": proc.pid}))
        with pytest.raises(DeepSpecError, match=f"pid {proc.pid}"):
            wait_for_exit(pid_file, 0.5)
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_goes_away_stops_the_job_in_one_line(tiny_cfg, tiny_target, tmp_path):
    """The server dies mid-run (its first answer is a 500, then it is gone):
    the job stops with one line naming its URL after connect_timeout_s, keeping
    what was done, instead of failing every record after its retries."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from deepspec.regeneration.regenerate import regenerate

    class Dying(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            threading.Thread(target=lambda: (srv.shutdown(), srv.server_close()), daemon=True).start()

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}/v1"
    cfg = {**tiny_cfg, "results_dir": str(tmp_path),
           "regenerate": {**tiny_cfg["regenerate"], "backend": "server", "urls": [url], "concurrency": 1,
                          "max_retries": 2, "retry_backoff_s": 0.2, "connect_timeout_s": 1}}
    prompts = [Prompt(id=f"d:{i}", turns=[f"Question {i}?"], source="d") for i in range(50)]
    t0 = time.monotonic()
    with pytest.raises(DeepSpecError, match=f"no OpenAI-compatible server answered at {url}/models within 1 s"):
        regenerate(cfg, tmp_path / "c.jsonl", prompts=prompts, target=tiny_target)
    assert time.monotonic() - t0 < 20 and (tmp_path / "c.jsonl.partial").exists()

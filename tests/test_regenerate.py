import copy
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from deepspec.data.prompts import Prompt
from deepspec.errors import DeepSpecError
from deepspec.paths import errors_path, settings_path
from deepspec.regeneration.regenerate import regenerate
from deepspec.regeneration.sampling import Sampling, filter_logits, sample_next
from deepspec.regeneration.shards import merge_shards, shard_of

PROMPTS = [
    Prompt(id="t:1", turns=["What is 2+2?"], source="t"),
    Prompt(id="t:2", turns=["Name a colour.", "And another one?"], source="t"),
    Prompt(id="t:3", turns=["Write a long story about a dragon who learns to bake bread in a small town."], source="t"),
]


def _cfg(tiny_cfg, tmp_path, **regen):
    cfg = copy.deepcopy(tiny_cfg)
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["regenerate"].update({"max_new_tokens": 6, "batch_size": 2, **regen})
    return cfg


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_filters_follow_hf_semantics():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cand, ids = filter_logits(logits, 1.0, top_k=3, top_p=1.0, min_p=0.0)
    assert ids.tolist() == [[0, 1, 2]] and torch.isfinite(cand).all()
    cand, ids = filter_logits(logits, 1.0, top_k=0, top_p=0.8, min_p=0.0)  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(cand).tolist() == [[True, True, False, False]]
    cand, _ = filter_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.5)  # keep p >= 0.25
    assert torch.isfinite(cand).tolist() == [[True, True, False, False]]


def test_sampling_is_per_row_seeded_and_matches_the_distribution(tiny_cfg):
    logits = torch.randn(3, 50)
    rc = Sampling(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0, max_new_tokens=8)
    a = sample_next(logits, [torch.Generator().manual_seed(s) for s in (1, 2, 3)], rc)
    b = sample_next(logits[1:2], [torch.Generator().manual_seed(2)], rc)
    assert a[1] == b[0]  # a row's draw does not depend on its batch mates
    # empirical frequencies follow the filtered distribution
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = torch.stack([sample_next(probs.log()[None], [g], dataclasses.replace(rc, temperature=1.0, top_p=1.0))[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.04)



def test_unfiltered_sampling_is_the_tempered_softmax(tiny_cfg):
    # top_k 0, top_p 1, min_p 0 (plain sampling at T): the whole vocabulary, unsorted, and draws
    # that follow softmax(logits / T)
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    cand, ids = filter_logits(logits, 2.0, top_k=0, top_p=1.0, min_p=0.0)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(cand, logits / 2.0)
    rc = Sampling(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=8)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, [g], rc)[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.03)

def test_duplicate_prompt_ids_are_named(tiny_cfg, tmp_path):
    with pytest.raises(DeepSpecError, match=r"^duplicate prompt id 't:2' in the training prompts$"):
        regenerate(_cfg(tiny_cfg, tmp_path), tmp_path / "conv.jsonl", prompts=[*PROMPTS, PROMPTS[1]])
    assert list(tmp_path.iterdir()) == []


def test_local_regeneration_multi_turn_resume_and_errors(tiny_cfg, tiny_target, tmp_path):
    cfg = _cfg(tiny_cfg, tmp_path)
    out = tmp_path / "conv.jsonl"
    stats = regenerate(cfg, out, prompts=PROMPTS, target=tiny_target)
    assert stats["done"] == 3 and stats["failed"] == 0 and 0 < stats["new_tokens"] <= 6 * 4
    recs = {r["id"]: r for r in _lines(out)}
    assert set(recs) == {"t:1", "t:2", "t:3"}
    two = recs["t:2"]["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
    assert two[2]["content"] == "And another one?" and recs["t:2"]["source"] == "t"
    # answers cut at max_new_tokens (here 4) are marked, so their end-of-turn is not a label
    answers = [m for r in recs.values() for m in r["messages"] if m["role"] == "assistant"]
    assert any(m.get("truncated") for m in answers)
    assert not out.with_name(out.name + ".partial").exists()

    # same seed -> same answers (fresh run into another file)
    again = tmp_path / "again.jsonl"
    regenerate(cfg, again, prompts=PROMPTS, target=tiny_target)
    assert {r["id"]: r for r in _lines(again)} == recs

    # a killed run: one finished record plus a truncated line; the rerun keeps the
    # first, drops the torn tail and does the rest
    partial = tmp_path / "resume.jsonl.partial"
    partial.write_text(json.dumps(recs["t:1"]) + "\n" + json.dumps(recs["t:2"])[:30])
    settings_path(tmp_path / "resume.jsonl").write_text(settings_path(out).read_text())  # the killed run's settings
    stats = regenerate(cfg, tmp_path / "resume.jsonl", prompts=PROMPTS, target=tiny_target)
    assert stats["skipped"] == 1 and stats["done"] == 2
    assert {r["id"]: r for r in _lines(tmp_path / "resume.jsonl")} == recs
    assert regenerate(cfg, tmp_path / "resume.jsonl", prompts=PROMPTS, target=tiny_target)["skipped"] == 3

    # other settings never reuse those records: the rerun starts over
    other = _cfg(tiny_cfg, tmp_path, max_new_tokens=3)
    assert regenerate(other, tmp_path / "resume.jsonl", prompts=PROMPTS, target=tiny_target)["done"] == 3
    assert all(len(m["content"]) < 40 for r in _lines(tmp_path / "resume.jsonl") for m in r["messages"][1::2])

    # an over-long history is skipped as "too long" and counted, never a failure (NR6):
    # under the default budget of 0 failures the job still succeeds
    cfg["data"]["max_prompt_tokens"] = 45
    bad = tmp_path / "bad.jsonl"
    assert cfg["regenerate"]["max_failed_fraction"] == 0.0
    stats = regenerate(cfg, bad, prompts=PROMPTS, target=tiny_target)
    errs = _lines(errors_path(bad))
    assert stats["too_long"] == len(errs) == 2 and stats["failed"] == 0 and stats["done"] == 1
    assert all(e["skipped"] == "too long" and "data.max_prompt_tokens=45" in e["error"] for e in errs)
    assert {r["id"] for r in _lines(bad)}.isdisjoint(e["id"] for e in errs) and len(_lines(bad)) == 1


class _FakeServer(BaseHTTPRequestHandler):
    bodies: list = []
    failures: list = []  # what the next requests get instead of an answer: 500, "short", "malformed", "close"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        last = body["messages"][-1]["content"]
        kind = type(self).failures.pop(0) if type(self).failures else None
        if "FAIL" in last or kind == 500:
            self.send_response(500)
            self.end_headers()
            return
        if kind in ("short", "malformed", "close"):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write({"short": b'{"choices": [', "malformed": b"<html>" + b" " * 994, "close": b""}[kind])
            return
        answer = f"answer {(len(body['messages']) + 1) // 2} to {last}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}],
                           "usage": {"completion_tokens": 3}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # /v1/models, which the job polls before it starts
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _FakeServer.bodies, _FakeServer.failures = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def test_server_backend(tiny_cfg, tiny_target, tmp_path, fake_server):
    cfg = _cfg(tiny_cfg, tmp_path, backend="server", urls=[fake_server, fake_server + "/v1"], concurrency=2,
               max_retries=2, retry_backoff_s=0.0, max_failed_fraction=0.25)
    prompts = PROMPTS + [Prompt(id="t:4", turns=["please FAIL"], source="t")]
    out = tmp_path / "conv.jsonl"
    stats = regenerate(cfg, out, prompts=prompts, target=tiny_target)
    assert stats["done"] == 3 and stats["failed"] == 1 and stats["new_tokens"] == 3 * 4
    assert sum("FAIL" in b["messages"][-1]["content"] for b in _FakeServer.bodies) == 3  # 1 + 2 retries
    recs = {r["id"]: r for r in _lines(out)}
    assert recs["t:2"]["messages"][3]["content"] == "answer 2 to And another one?"
    assert "HTTP 500" in _lines(errors_path(out))[0]["error"]
    b = _FakeServer.bodies[0]
    assert b["top_k"] == 20 and b["min_p"] == 0.0 and b["top_p"] == 0.8 and b["temperature"] == 0.7
    assert b["chat_template_kwargs"] == {"enable_thinking": False} and b["max_tokens"] == 6
    # the second turn is conditioned on the regenerated first answer
    second = [x for x in _FakeServer.bodies if x["messages"][-1]["content"] == "And another one?"][0]
    assert second["messages"][1] == {"role": "assistant", "content": "answer 1 to Name a colour."}


def test_server_backend_needs_urls(tiny_cfg, tmp_path):
    with pytest.raises(DeepSpecError, match="regenerate.urls"):
        regenerate(_cfg(tiny_cfg, tmp_path, backend="server"), tmp_path / "c.jsonl", prompts=PROMPTS)


def test_server_errors_are_retried_then_counted(tiny_cfg, tiny_target, tmp_path, fake_server):
    """500s, short, malformed and empty bodies are retried with backoff; what
    still fails is recorded, and past the failure budget (default 0) the job
    fails with one line while a rerun retries only the failed records."""
    prompts = [Prompt(id=f"s:{i}", turns=[f"Question {i}?"], source="s") for i in range(12)]
    cfg = _cfg(tiny_cfg, tmp_path, backend="server", urls=[fake_server], concurrency=1, max_retries=5,
               retry_backoff_s=0.0)
    _FakeServer.failures = [500, 500, "short", "malformed", "close"]  # the first five requests
    out = tmp_path / "conv.jsonl"
    assert regenerate(cfg, out, prompts=prompts, target=tiny_target)["done"] == 12 and not errors_path(out).read_text()

    out2 = tmp_path / "conv2.jsonl"
    cfg["regenerate"]["max_retries"] = 1
    _FakeServer.failures = [500] * 4  # two records fail twice each
    with pytest.raises(DeepSpecError, match=r"2 of 12 records failed"):
        regenerate(cfg, out2, prompts=prompts, target=tiny_target)
    assert len(_lines(errors_path(out2))) == 2 and not out2.exists()
    n = len(_FakeServer.bodies)
    stats = regenerate(cfg, out2, prompts=prompts, target=tiny_target)
    assert stats["done"] == 2 and stats["skipped"] == 10
    assert len(_FakeServer.bodies) == n + 2  # only the two failed records were asked again
    assert len(_lines(out2)) == 12


def test_shards_regenerate_the_same_records_and_merge_in_prompt_order(tiny_cfg, tiny_target, tmp_path):
    cfg = _cfg(tiny_cfg, tmp_path, max_failed_fraction=0.5)
    cfg["data"]["max_prompt_tokens"] = 45  # t:3's prompt (at least) is over it: error records
    prompts = PROMPTS + [Prompt(id=f"u:{i}", turns=[f"Count to {i}."], source="u") for i in range(4)]
    whole = tmp_path / "whole.jsonl"
    regenerate(cfg, whole, prompts=prompts, target=tiny_target)
    assert [p.id for p in shard_of(prompts, 1, 3)] == ["t:2", "u:1"]
    with pytest.raises(DeepSpecError, match="0..2"):
        shard_of(prompts, 3, 3)
    parts = [tmp_path / f"s{i}.jsonl" for i in range(3)]
    for i, part in enumerate(parts):
        regenerate(cfg, part, prompts=shard_of(prompts, i, 3), target=tiny_target)
    out = tmp_path / "merged.jsonl"
    failed = [r["id"] for r in _lines(errors_path(whole))]
    assert "t:3" in failed and merge_shards(cfg, parts, out, prompts=prompts) == len(prompts) - len(failed)
    # each record has its own seed: the same answers as one job, in the prompts' order
    merged = _lines(out)
    assert [r["id"] for r in merged] == [p.id for p in prompts if p.id not in failed]
    assert {r["id"]: r for r in merged} == {r["id"]: r for r in _lines(whole)}
    assert [r["id"] for r in _lines(errors_path(out))] == [p.id for p in prompts if p.id in failed]
    assert json.loads(settings_path(out).read_text()) == json.loads(settings_path(whole).read_text())
    # what does not add up fails with one line naming the file
    with pytest.raises(DeepSpecError, match="in no shard"):
        merge_shards(cfg, parts[:2], tmp_path / "m2.jsonl", prompts=prompts)
    with pytest.raises(DeepSpecError, match=r"s0.jsonl:1: record '.+' is also in .*s0.jsonl"):
        merge_shards(cfg, [parts[0], parts[0]], tmp_path / "m3.jsonl", prompts=prompts)
    with pytest.raises(DeepSpecError, match="other settings"):
        merge_shards(_cfg(tiny_cfg, tmp_path, max_new_tokens=3), parts, tmp_path / "m4.jsonl", prompts=prompts)
    with pytest.raises(DeepSpecError, match="not a training prompt"):
        merge_shards(cfg, parts, tmp_path / "m5.jsonl", prompts=prompts[1:])
    assert not any((tmp_path / f"m{i}.jsonl").exists() for i in (2, 3, 4, 5))


def test_over_long_histories_are_skipped_in_server_mode_too(tiny_cfg, tiny_target, tmp_path, fake_server):
    """NR6: with a server no prompt length was checked, so one over-long history
    (HTTP 400 from vLLM, final) failed a day of regeneration under the default
    budget of 0 failures. Now a history over data.max_prompt_tokens is skipped as
    "too long" before it is sent, counted, and the job succeeds."""
    cfg = _cfg(tiny_cfg, tmp_path, backend="server", urls=[fake_server], concurrency=2, max_retries=0)
    cfg["data"]["max_prompt_tokens"] = 45
    assert cfg["regenerate"]["max_failed_fraction"] == 0.0
    out = tmp_path / "conv.jsonl"
    stats = regenerate(cfg, out, prompts=PROMPTS, target=tiny_target)
    errs = {e["id"]: e for e in _lines(errors_path(out))}
    assert stats["failed"] == 0 and stats["too_long"] == len(errs) >= 1 and "t:3" in errs
    assert all(e["skipped"] == "too long" and "over data.max_prompt_tokens=45" in e["error"] for e in errs.values())
    assert not any("dragon" in b["messages"][-1]["content"] for b in _FakeServer.bodies)  # never sent
    assert {r["id"] for r in _lines(out)} == {p.id for p in PROMPTS} - set(errs)


def test_two_regenerations_of_one_file_do_not_share_its_partial(tiny_cfg, tiny_target, tmp_path):
    """NR15: a second regeneration of the same output (a restarted controller's
    rerun while the first still runs) stops in one line instead of appending to
    the same .partial; the first finishes whole and leaves no lock behind."""
    gate, entered = threading.Event(), threading.Event()

    class Slow(_FakeServer):
        def do_POST(self):
            entered.set()
            gate.wait(30)
            super().do_POST()

    _FakeServer.bodies, _FakeServer.failures = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cfg = _cfg(tiny_cfg, tmp_path, backend="server", urls=[f"http://127.0.0.1:{srv.server_port}"], concurrency=1)
        out, first = tmp_path / "c.jsonl", {}
        th = threading.Thread(target=lambda: first.update(regenerate(cfg, out, prompts=PROMPTS, target=tiny_target)))
        th.start()
        assert entered.wait(30)
        with pytest.raises(DeepSpecError, match=r"another regeneration is writing .*c\.jsonl \(lock .*c\.jsonl\.lock\)"):
            regenerate(cfg, out, prompts=PROMPTS, target=tiny_target)
        gate.set()
        th.join(60)
    finally:
        gate.set()
        srv.shutdown()
        srv.server_close()
    assert first["done"] == 3 and sorted(r["id"] for r in _lines(out)) == ["t:1", "t:2", "t:3"]
    assert not (tmp_path / "c.jsonl.lock").exists() and not (tmp_path / "c.jsonl.partial").exists()


def test_the_merge_streams_its_records(tiny_cfg, tmp_path):
    """NR7: the merge held every record and one joined string (~34 GB for 1.2 M
    records). Streamed, its memory is the index (16 bytes a record) and the
    prompt ids, a small fraction of the records; the output is the same bytes in
    the prompts' order."""
    import tracemalloc

    from deepspec.config import settings_fingerprint

    cfg = _cfg(tiny_cfg, tmp_path)
    n = 4000
    prompts = [Prompt(id=f"m:{i}", turns=["q"], source="m") for i in range(n)]
    fp = settings_fingerprint(cfg, "regenerate")
    parts, want = [tmp_path / f"s{k}.jsonl" for k in range(2)], {}
    for k, part in enumerate(parts):
        lines = []
        for i in reversed(range(k, n, 2)):  # out of order, as a shard appends them
            rec = {"id": f"m:{i}", "source": "m", "messages": [{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": f"{i} é " + "x" * 4000}]}
            want[rec["id"]] = json.dumps(rec, ensure_ascii=False) + "\n"
            lines.append(want[rec["id"]])
        errs = [lines.pop()]  # the shard's first prompt failed
        part.write_text("".join(lines))
        errors_path(part).write_text(errs[0])
        settings_path(part).write_text(json.dumps({"fingerprint": fp}))
    total = sum(p.stat().st_size for p in parts)
    out = tmp_path / "merged.jsonl"
    tracemalloc.start()
    try:
        assert merge_shards(cfg, parts, out, prompts=prompts) == n - 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < total / 20, (peak, total)
    assert out.read_text() == "".join(want[f"m:{i}"] for i in range(2, n))
    assert errors_path(out).read_text() == want["m:0"] + want["m:1"]

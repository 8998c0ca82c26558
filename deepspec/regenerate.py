"""Regenerate every training answer with the target itself (paper §3, "Regeneration").

Input: training prompts (`deepspec.data.load_train_prompts`). Output: one
conversation per line, ``{"id", "source", "messages"}``, every assistant turn
sampled from the target with cfg.regenerate's parameters (non-thinking).
Multi-turn prompts are answered turn by turn, each turn conditioned on the
regenerated history.

Back ends
  * ``local`` (CPU default): in-process batched sampling with a KV cache.
    Prompts are sorted by length and batched to minimise (left) padding; rows
    leave the batch at EOS. Each record samples from its own
    ``torch.Generator`` seeded from (regenerate.seed, record id, turn), so a
    record's answer does not depend on which other records share its batch or
    on whether the run was resumed.
  * ``server``: an OpenAI-compatible chat endpoint (SGLang or vLLM), several
    URLs, a thread pool of ``concurrency`` requests per URL, plain urllib.
    top_k / min_p go in the request body (both servers accept them there) and
    ``chat_template_kwargs.enable_thinking = false``.

Resumable and never half-written: records are appended (one write + fsync per
batch) to ``<out>.partial``; on start a truncated last line is dropped and the
ids already there are skipped; when the run ends the file is renamed onto
``<out>``. Failures (over-long prompts, server errors) go to
``<out stem>.errors.jsonl`` with the reason and are retried by the next run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .chat import with_system_prompt
from .data import Prompt, load_train_prompts
from .io import DeepSpecError
from .targets import cache_kwarg

log = logging.getLogger(__name__)


def default_out(cfg: dict) -> Path:
    return Path(cfg["results_dir"]) / cfg["target"]["name"] / "regen" / "conversations.jsonl"


def errors_path(out: Path) -> Path:
    return out.with_name(out.stem + ".errors.jsonl")


def record_seed(seed: int, record_id: str, turn: int) -> int:
    """A stable 63-bit seed per (run seed, record, turn)."""
    h = hashlib.sha256(f"{seed}\0{record_id}\0{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


# ---------------------------------------------------------------- sampling


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates after temperature, top-k, top-p and min-p (HF order).

    Returns (logits [B, K], token ids [B, K]) sorted by decreasing logit,
    -inf where filtered out; K = top_k (or the vocabulary when top_k == 0), so
    the usual top_k = 20 never sorts the whole vocabulary.
    """
    logits = logits.float() / temperature
    k = top_k if 0 < top_k < logits.shape[-1] else logits.shape[-1]
    logits, ids = torch.topk(logits, k, dim=-1)  # sorted, descending
    if top_p < 1.0:
        p = torch.softmax(logits, dim=-1)
        drop = (p.cumsum(-1) - p) >= top_p  # the mass before this token already reaches top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        p = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(p < min_p * p[..., :1], float("-inf"))
    return logits, ids


def sample_next(logits: torch.Tensor, generators: Sequence[torch.Generator], rc: dict) -> torch.Tensor:
    """One token per row, row r drawn with generators[r]; greedy when T == 0."""
    if rc["temperature"] <= 0:
        return logits.argmax(-1)
    cand, ids = filter_logits(logits, rc["temperature"], rc["top_k"], rc["top_p"], rc["min_p"])
    # Inverse-CDF sampling with one uniform per row from that row's generator
    # (torch.multinomial with a generator costs ~15 ms per row over a 49k vocabulary).
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(cand.device)
    cdf = torch.softmax(cand, dim=-1).double().cumsum(-1)
    j = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(cand.shape[-1] - 1)
    return ids.gather(-1, j)[:, 0]


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    generators: Sequence[torch.Generator],
    rc: dict,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    on_step: Optional[Callable[[int], None]] = None,
) -> list[list[int]]:
    """Sample continuations of left-padded `prompts` with a KV cache.

    Each row stops at its first EOS (included in the result) or after
    rc['max_new_tokens']; finished rows are dropped from the batch (and its
    cache) so they cost nothing more. `on_step(n)` reports n new tokens.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    am = torch.zeros((B, L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p):] = torch.tensor(p)
        am[r, L - len(p):] = 1
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    ids, am, pos = ids.to(device), am.to(device), pos.to(device)
    cache = DynamicCache(config=model.config)
    ckw = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, **{ckw: cache}, use_cache=True, logits_to_keep=1)
    next_pos = pos[:, -1] + 1
    alive = list(range(B))
    gens = list(generators)
    results: list[list[int]] = [[] for _ in range(B)]
    eos = set(int(e) for e in eos_ids)
    for step in range(rc["max_new_tokens"]):
        toks = sample_next(out.logits[:, -1], gens, rc)
        keep = []
        for j, (r, t) in enumerate(zip(alive, toks.tolist())):
            results[r].append(t)
            if t not in eos:
                keep.append(j)
        if on_step:
            on_step(len(alive))
        if not keep or step == rc["max_new_tokens"] - 1:
            break
        if len(keep) < len(alive):
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            am, next_pos, toks = am[idx], next_pos[idx], toks[idx]
            alive, gens = [alive[j] for j in keep], [gens[j] for j in keep]
        am = torch.cat([am, am.new_ones((len(alive), 1))], dim=1)
        out = model(
            input_ids=toks[:, None].to(device),
            attention_mask=am,
            position_ids=next_pos[:, None],
            **{ckw: cache},
            use_cache=True,
        )
        next_pos = next_pos + 1
    return results


# ---------------------------------------------------------------- output file


def _recover_partial(path: Path) -> set[str]:
    """Ids already in an append-only JSONL; a truncated or invalid last line is cut off."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    done: set[str] = set()
    good = 0
    lines = data.split(b"\n")
    for k, line in enumerate(lines):
        last = k == len(lines) - 1
        if last and not line:
            break
        try:
            rec = json.loads(line)
            if last:
                raise ValueError("no newline")  # a complete record always ends with one
            done.add(rec["id"])
        except (ValueError, KeyError, TypeError):
            if k >= len(lines) - 2:  # the tail: drop it
                log.warning("%s: dropping a truncated last line", path)
                break
            raise DeepSpecError(f"{path}:{k + 1}: corrupt record in the middle of the file") from None
        good += len(line) + 1
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


class _Appender:
    """Append whole lines and fsync, so a kill never leaves a half record behind
    (and if it does, `_recover_partial` cuts it off)."""

    def __init__(self, path: Path, mode: str = "a"):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, mode, encoding="utf-8")

    def write(self, recs: list[dict]) -> None:
        if recs:
            self.f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            self.f.flush()
            os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# ---------------------------------------------------------------- back ends


def _regenerate_local(cfg, prompts: list[Prompt], write, fail, bar, target=None) -> int:
    from .targets import target_from_config

    rc, system = cfg["regenerate"], cfg["data"].get("system_prompt")
    target = target or target_from_config(cfg)
    tok, limit = target.tokenizer, cfg["data"]["max_prompt_tokens"]
    first = {p.id: len(target.chat_ids(with_system_prompt([{"role": "user", "content": p.turns[0]}], system))) for p in prompts}
    order = sorted(prompts, key=lambda p: (first[p.id], p.id))
    n_tokens, shown = 0, time.perf_counter()

    def on_step(n):  # the bar counts records; show tokens/s while a batch is still running
        nonlocal n_tokens, shown
        n_tokens += n
        if time.perf_counter() - shown > 1.0:
            shown = time.perf_counter()
            bar.set_postfix_str(f"{n_tokens} tok, {n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")

    for b in range(0, len(order), rc["batch_size"]):
        batch = order[b : b + rc["batch_size"]]
        convs = {p.id: [] for p in batch}
        failed: dict[str, str] = {}
        for turn in range(max(len(p.turns) for p in batch)):
            rows, ids = [], []
            for p in batch:
                if p.id in failed or turn >= len(p.turns):
                    continue
                convs[p.id].append({"role": "user", "content": p.turns[turn]})
                x = target.chat_ids(with_system_prompt(convs[p.id], system))
                if len(x) > limit:
                    failed[p.id] = f"prompt of turn {turn} has {len(x)} tokens, over data.max_prompt_tokens={limit}"
                    continue
                rows.append(p)
                ids.append(x)
            if not rows:
                continue
            gens = [torch.Generator().manual_seed(record_seed(rc["seed"], p.id, turn)) for p in rows]
            outs = generate_batch(target.model, ids, gens, rc, eos_ids=target.eos_token_ids, pad_id=tok.pad_token_id, on_step=on_step)
            for p, o in zip(rows, outs):
                truncated = not (o and o[-1] in target.eos_token_ids)
                o = [t for t in o if t not in target.eos_token_ids]
                msg = {"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)}
                convs[p.id].append({**msg, "truncated": True} if truncated else msg)
        write([{"id": p.id, "source": p.source, "messages": convs[p.id]} for p in batch if p.id not in failed])
        for p in batch:
            if p.id in failed:
                fail(p, failed[p.id])
        bar.update(len(batch))
    return n_tokens


def _chat_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _answer_with_server(url: str, prompt: Prompt, cfg: dict) -> tuple[list[dict], int]:
    rc, system = cfg["regenerate"], cfg["data"].get("system_prompt")
    model = rc.get("model_name") or cfg["target"]["spec"]
    msgs: list[dict] = []
    n = 0
    for turn, text in enumerate(prompt.turns):
        msgs.append({"role": "user", "content": text})
        body = {
            "model": model,
            "messages": with_system_prompt(msgs, system),
            "temperature": rc["temperature"],
            "top_p": rc["top_p"],
            "top_k": rc["top_k"] if rc["top_k"] > 0 else -1,
            "min_p": rc["min_p"],
            "max_tokens": rc["max_new_tokens"],
            "seed": record_seed(rc["seed"], prompt.id, turn) & 0x7FFFFFFF,
            "n": 1,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        resp = _post_json(url, body, rc["request_timeout_s"])
        try:
            content = resp["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"unexpected response: {json.dumps(resp)[:200]}") from None
        if not isinstance(content, str):
            raise ValueError("response without text content")
        n += int((resp.get("usage") or {}).get("completion_tokens", 0))
        msg = {"role": "assistant", "content": content}
        msgs.append({**msg, "truncated": True} if resp["choices"][0].get("finish_reason") == "length" else msg)
    return msgs, n


def _regenerate_server(cfg, prompts: list[Prompt], write, fail, bar) -> int:
    rc = cfg["regenerate"]
    urls = [_chat_url(u) for u in rc["urls"]]
    if not urls:
        raise DeepSpecError("regenerate.backend is 'server' but regenerate.urls is empty (e.g. --set regenerate.urls=[http://localhost:30000])")
    n_tokens = 0
    with ThreadPoolExecutor(max_workers=rc["concurrency"] * len(urls)) as pool:
        futs = {pool.submit(_answer_with_server, urls[k % len(urls)], p, cfg): p for k, p in enumerate(prompts)}
        for fut in as_completed(futs):
            p = futs[fut]
            try:
                msgs, n = fut.result()
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = f"HTTP {e.code}: {e.reason}" if isinstance(e, urllib.error.HTTPError) else f"{type(e).__name__}: {e}"
                fail(p, reason)
            else:
                write([{"id": p.id, "source": p.source, "messages": msgs}])
                n_tokens += n
            bar.update(1)
            bar.set_postfix_str(f"{n_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
    return n_tokens


# ---------------------------------------------------------------- driver


def regenerate(cfg: dict, out: Optional[str | os.PathLike] = None, *, prompts: Optional[list[Prompt]] = None, target=None) -> dict:
    """Regenerate the answers of `prompts` (default: the preset's training prompts)
    into `out`; returns stats {done, skipped, failed, new_tokens, seconds, tokens_per_s}."""
    from tqdm.auto import tqdm

    out = Path(out) if out else default_out(cfg)
    partial = out.with_name(out.name + ".partial")
    prompts = load_train_prompts(cfg) if prompts is None else prompts
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise DeepSpecError("duplicate prompt ids in the training prompts")
    if out.exists():  # reopen a finished file to add what is missing (e.g. a larger cap)
        done = _recover_partial(out)
        if done.issuperset(ids):
            log.info("%s: all %d records already regenerated", out, len(ids))
            return {"done": 0, "skipped": len(ids), "failed": 0, "new_tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
        if partial.exists():
            raise DeepSpecError(f"both {out} and {partial} exist: remove one")
        os.replace(out, partial)
    done = _recover_partial(partial)
    todo = [p for p in prompts if p.id not in done]
    log.info("regenerating %d of %d records (%d already done) with backend %s", len(todo), len(ids), len(ids) - len(todo), cfg["regenerate"]["backend"])

    appender, errors = _Appender(partial), _Appender(errors_path(out), mode="w")
    n_failed = 0

    def fail(p: Prompt, reason: str) -> None:
        nonlocal n_failed
        n_failed += 1
        log.warning("record %s failed: %s", p.id, reason)
        errors.write([{"id": p.id, "source": p.source, "error": reason}])

    t0 = time.perf_counter()
    try:
        with tqdm(total=len(todo), desc="regenerate", unit="rec", dynamic_ncols=True) as bar:
            if not todo:
                n_tokens = 0
            elif cfg["regenerate"]["backend"] == "server":
                n_tokens = _regenerate_server(cfg, todo, appender.write, fail, bar)
            else:
                n_tokens = _regenerate_local(cfg, todo, appender.write, fail, bar, target=target)
    finally:
        appender.close()
        errors.close()
    secs = time.perf_counter() - t0
    if n_failed == len(ids) and ids:
        raise DeepSpecError(f"all {len(ids)} records failed; reasons in {errors_path(out)}")
    os.replace(partial, out)
    stats = {
        "done": len(todo) - n_failed,
        "skipped": len(ids) - len(todo),
        "failed": n_failed,
        "new_tokens": n_tokens,
        "seconds": round(secs, 3),
        "tokens_per_s": round(n_tokens / secs, 2) if secs > 0 else 0.0,
    }
    log.info("regenerated %(done)d records (%(skipped)d skipped, %(failed)d failed): %(new_tokens)d tokens in "
             "%(seconds).1f s = %(tokens_per_s).1f tok/s", stats)
    if n_failed:
        log.warning("%d failures listed in %s (a rerun retries them)", n_failed, errors_path(out))
    return stats


def cli_regenerate(argv) -> int:
    from .cli import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec regenerate", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--out", help="conversations JSONL (default: <results>/<target>/regen/conversations.jsonl)")
    p.add_argument("--limit", type=int, help="only the first N training prompts (quick runs)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    prompts = load_train_prompts(cfg)
    if args.limit:
        prompts = prompts[: args.limit]
    regenerate(cfg, args.out, prompts=prompts)
    return 0

"""Regenerated conversations (JSONL, one per line) -> training samples: token
ids and the assistant loss mask, via the target's chat template.

The loss mask marks the tokens a drafter must learn to predict: the content of
every assistant turn *and* the end-of-turn token that closes it (the drafter
has to predict it too). It is found template-agnostically by rendering
prefixes of the conversation as text:

    span of assistant turn i = render(messages[:i+1])  minus  render(messages[:i], add_generation_prompt=True)

i.e. what rendering the turn adds, less the generation-prompt header
(``<|im_start|>assistant\\n`` and the like). Trailing whitespace after the
end-of-turn marker (the ``\\n`` after ``<|im_end|>``) is not part of the turn.
The full conversation is tokenised once with character offsets and a token is
a loss token when it overlaps an assistant span, so BPE merges across span
boundaries cannot shift the mask.

Templates that render a non-final turn differently from the final one (Qwen3 adds
an empty ``<think>`` block only to the final assistant turn) break the prefix
property; for those the assistant content is located in the full text in order
(see `assistant_char_spans`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..core.target import render_chat
from ..errors import DeepSpecError
from ..files import file_lock, iter_jsonl, read_json, require_file, sha256_file, write_json_atomic
from ..settings import Data, Settings

log = logging.getLogger(__name__)

ROLES = ("user", "assistant")


def with_system_prompt(messages: list[dict], system_prompt: Optional[str]) -> list[dict]:
    """Prepend data.system_prompt (if any); we never add one otherwise."""
    if system_prompt:
        return [{"role": "system", "content": system_prompt}, *messages]
    return list(messages)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return (text, [(start, end) char span per assistant turn]).

    A span covers the turn's content and its end-of-turn marker, except for a
    turn marked ``"truncated": true`` (cut at the token limit), whose marker the
    target never produced."""
    text = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if text.startswith(upto) and upto.startswith(head) and len(head) >= cursor:
            start, end = len(head), len(upto)
        else:  # history re-rendered differently: find the content, then the template's closing text
            content = m["content"].strip()
            start = text.find(content, cursor) if content else -1
            at = upto.rfind(content) if content else -1
            if start < 0 or at < 0:
                raise DeepSpecError(f"cannot locate assistant turn {i} in the rendered chat template")
            closing = upto[at + len(content):]
            end = start + len(content)
            if text.startswith(closing, end):
                end += len(closing)
        end = start + len(text[start:end].rstrip())  # the end-of-turn marker closes the turn
        if m.get("truncated"):
            # Cut off at regenerate.max_new_tokens: the target never produced the
            # end-of-turn marker the template adds, so it is not a training label.
            content = m["content"].strip()
            at = text.find(content, start, end) if content else -1
            end = at + len(content) if at >= 0 else end
        spans.append((start, end))
        cursor = end
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and its assistant loss mask."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [False] * len(ids)
    j = 0
    for k, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j < len(spans) and b > spans[j][0] and a < spans[j][1] and b > a:
            mask[k] = True
    return ids, mask


def encode_conversation(tokenizer, messages: list[dict], data: Data) -> Optional[tuple[list[int], list[bool]]]:
    """Template + mask, truncated at data.max_length; None if it has fewer than
    data.min_loss_tokens loss tokens (the sample is dropped)."""
    ids, mask = tokenize_conversation(tokenizer, with_system_prompt(messages, data.system_prompt))
    ids, mask = ids[: data.max_length], mask[: data.max_length]
    if sum(mask) < data.min_loss_tokens:
        return None
    return ids, mask


def validate_conversation(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise DeepSpecError(f"{where}: a conversation must be a JSON object")
    if not isinstance(rec.get("id"), str):
        raise DeepSpecError(f"{where}: missing string 'id'")
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DeepSpecError(f"{where}: 'messages' must be a non-empty list")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DeepSpecError(f"{where}: message {k} must be {{'role': 'user'|'assistant', 'content': str}}")
    return rec


def iter_conversations(path: str | os.PathLike) -> Iterator[dict]:
    """Validated records of a conversations JSONL (one-line errors name file:line)."""
    hint = " (run python -m deepspec regenerate)"
    for _, where, rec in iter_jsonl(path, "conversations file", hint):
        yield validate_conversation(rec, where)


def read_conversations(path: str | os.PathLike) -> list[dict]:
    out = list(iter_conversations(path))
    seen = set()
    for rec in out:
        if rec["id"] in seen:
            raise DeepSpecError(f"{path}: duplicate conversation id {rec['id']!r}")
        seen.add(rec["id"])
    if not out:
        raise DeepSpecError(f"{path}: no conversations")
    return out


@dataclass
class TokenizedSample:
    id: str
    input_ids: Sequence[int]  # a slice of the int32 id array (`TokenArrays`), or a list
    loss_mask: Sequence[bool]


def _id_key(sample_id: str):
    """Natural order of "<source>:<line>" ids (line numerically)."""
    source, _, n = sample_id.rpartition(":")
    return (source, int(n), "") if n.isdigit() else (sample_id, -1, sample_id)


TOKENS_VERSION = 1


class TokenArrays:
    """The tokenized training samples as compact arrays: ``input_ids`` int32
    [T], ``loss_mask`` bool [T] (both memory-mapped read-only from the token
    file, so every process on a machine shares one copy in the page cache),
    ``offsets`` int64 [n+1] and the sample ids. Indexing gives
    `TokenizedSample`s whose ids and mask are slices (views) of the arrays."""

    def __init__(self, directory: Path):
        import numpy as np

        self.dir = Path(directory)
        meta = read_json(self.dir / "meta.json")
        self.sample_ids, self.stats, self.digest = meta["ids"], meta["stats"], meta["digest"]
        self.input_ids = np.load(self.dir / "input_ids.npy", mmap_mode="r")
        self.loss_mask = np.load(self.dir / "loss_mask.npy", mmap_mode="r")
        self.offsets = np.load(self.dir / "offsets.npy")

    def __len__(self) -> int:
        return len(self.sample_ids)

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return TokenizedSample(self.sample_ids[j], self.input_ids[a:b], self.loss_mask[a:b])

    def __iter__(self):
        return (self[j] for j in range(len(self)))


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256((blob + str(getattr(tokenizer, "chat_template", ""))).encode()).hexdigest()


_WORKER = {}  # what a tokenising worker process holds: the tokenizer and the data settings (`_encode_chunk`)


def _init_worker(tokenizer, data: Data) -> None:
    _WORKER.update(tokenizer=tokenizer, data=data)


def _encode_chunk(chunk):
    """[(id, messages)] -> [(id, int32 ids, bool mask) or (id, None)] in the same order."""
    import numpy as np

    out = []
    for cid, messages in chunk:
        enc = encode_conversation(_WORKER["tokenizer"], messages, _WORKER["data"])
        out.append((cid, None) if enc is None else (cid, np.asarray(enc[0], dtype=np.int32),
                                                     np.asarray(enc[1], dtype=bool)))
    return out


def _encoded(data: Data, tokenizer, convs: list, workers: int):
    """The conversations encoded in their order, by `workers` processes (chunks of a
    few hundred, results in submission order: the same arrays as one process)."""
    items = [(c["id"], c["messages"]) for c in convs]
    chunk = max(1, min(512, len(items) // (4 * max(1, workers)) or 1))
    chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]
    if workers <= 1 or len(chunks) <= 1:
        _init_worker(tokenizer, data)
        for c in chunks:
            yield from _encode_chunk(c)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the fast tokenizer's own threads, per worker
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork"), initializer=_init_worker,
                             initargs=(tokenizer, data)) as pool:
        done = 0
        for part in pool.map(_encode_chunk, chunks):
            done += len(part)
            if done % 50000 < len(part):
                log.info("tokenised %d of %d conversations", done, len(items))
            yield from part


def _write_token_arrays(data: Data, tokenizer, conversations, final: Path, workers: int = 1) -> None:
    """Tokenise every conversation once into `final` (a directory), written
    under a temporary name and renamed into place (atomic); `workers`
    processes encode in parallel, with the same bytes as one."""
    import numpy as np

    convs = sorted(read_conversations(conversations), key=lambda c: _id_key(c["id"]))
    ids, masks, lengths, names = [], [], [0], []
    for enc in _encoded(data, tokenizer, convs, workers):
        if enc[1] is not None:
            ids.append(enc[1])
            masks.append(enc[2])
            lengths.append(len(enc[1]))
            names.append(enc[0])
    n_convs = len(convs)
    del convs
    if not names:
        raise DeepSpecError(f"{conversations}: no sample has at least data.min_loss_tokens={data.min_loss_tokens} loss tokens")
    arrays = {"input_ids": np.concatenate(ids), "loss_mask": np.concatenate(masks),
              "offsets": np.cumsum(np.asarray(lengths, dtype=np.int64))}
    h = hashlib.sha256(json.dumps(names).encode())
    for k in ("input_ids", "loss_mask", "offsets"):
        h.update(arrays[k].tobytes())
    stats = {"conversations": n_convs, "dropped_min_loss_tokens": n_convs - len(names)}
    tmp = final.with_name(f"{final.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for k, v in arrays.items():
        np.save(tmp / f"{k}.npy", v)
    write_json_atomic(tmp / "meta.json", {"version": TOKENS_VERSION, "ids": names, "stats": stats, "digest": h.hexdigest()})
    try:
        os.rename(tmp, final)
    except OSError:  # another process (without a lock) got there first: same content
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "meta.json").exists():
            raise


def _settings_key(data: Data, tokenizer) -> dict:
    return {"version": TOKENS_VERSION, "tokenizer": _tokenizer_digest(tokenizer), "max_length": data.max_length,
            "min_loss_tokens": data.min_loss_tokens, "system_prompt": data.system_prompt}


def token_arrays_path(data: Data, tokenizer, conversations) -> Path:
    """Where the token arrays of these conversations, tokenizer and data
    settings live: beside the conversations, named by a digest of all three."""
    key = json.dumps(dict(_settings_key(data, tokenizer), conversations=sha256_file(conversations)), sort_keys=True)
    p = Path(conversations)
    return p.with_name(f"{p.stem}.tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def _file_stat(path) -> dict:
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def recorded_token_arrays(data: Data, tokenizer, conversations, record) -> Optional[Path]:
    """The arrays the tokenize rule recorded for these conversations (`record`, its
    JSON) when the record names this very file (path, size and mtime) and these
    settings, so that no training rank re-hashes a multi-GB conversations file; else None."""
    try:
        rec = json.loads(Path(record).read_text())
        ok = (rec.get("conversations") == _file_stat(conversations)
              and rec.get("settings") == _settings_key(data, tokenizer))
    except (OSError, ValueError, AttributeError):
        return None
    arrays = Path(rec.get("arrays", ""))
    return arrays if ok and (arrays / "meta.json").exists() else None


def tokenized_samples(data: Data, tokenizer, conversations: str | os.PathLike,
                      workers: int = 1, record: str | os.PathLike | None = None) -> tuple[TokenArrays, dict]:
    """The conversations tokenised (chat template + loss mask), in id order,
    without the samples with fewer than data.min_loss_tokens loss tokens, as
    memory-mapped `TokenArrays`. Tokenised once per (conversations,
    tokenizer, data settings): the first process writes the arrays under a
    file lock, every other process (other ranks, other methods' jobs,
    resumes) waits for the lock and maps the same file. In the DAG the tokenize
    rule (`cli_tokenize`, `workers` processes) writes them before any training job,
    and its `record` names them without hashing the conversations again."""
    require_file(conversations, "conversations file")
    if record is not None and (known := recorded_token_arrays(data, tokenizer, conversations, record)) is not None:
        arrays = TokenArrays(known)
        return arrays, arrays.stats
    final = token_arrays_path(data, tokenizer, conversations)
    if not (final / "meta.json").exists():
        with file_lock(final.with_name(final.name + ".lock"), unlocked="tokenising without one (every process tokenises, the first rename wins: the same bytes)"):
            if not (final / "meta.json").exists():
                log.info("tokenising %s into %s", conversations, final)
                _write_token_arrays(data, tokenizer, conversations, final, workers)
    arrays = TokenArrays(final)
    return arrays, arrays.stats


def cli_tokenize(argv) -> int:
    """The tokenize rule: the training conversations tokenised once, by a pool of
    processes, before the cache and training jobs (which then map the arrays);
    `--out` records where the arrays are (a JSON the DAG tracks)."""
    import argparse

    from ..config import add_config_args, config_from_args
    from ..paths import RunPaths
    from ..targets.loading import load_tokenizer

    p = argparse.ArgumentParser(prog="deepspec tokenize", description="tokenise the regenerated conversations once")
    add_config_args(p)
    p.add_argument("--conversations", help="regenerated conversations (default: the run's)")
    p.add_argument("--out", help="record of the token arrays (default: <results>/<target>/regen/tokens.json)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenising processes (default: all CPUs)")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise DeepSpecError(f"--workers {args.workers}: at least 1")
    s = Settings.of(config_from_args(args))
    paths = RunPaths.of(s)
    conversations = args.conversations or paths.conversations()
    tokenizer = load_tokenizer(s)
    arrays, stats = tokenized_samples(s.data, tokenizer, conversations, workers=args.workers)
    out = Path(args.out) if args.out else paths.tokens_record()
    write_json_atomic(out, {"arrays": str(arrays.dir), "samples": len(arrays), "tokens": int(arrays.offsets[-1]),
                            "digest": arrays.digest, "stats": stats, "conversations": _file_stat(conversations),
                            "settings": _settings_key(s.data, tokenizer)})
    log.info("%d samples, %d tokens in %s", len(arrays), int(arrays.offsets[-1]), arrays.dir)
    return 0

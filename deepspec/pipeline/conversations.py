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

Templates that re-render history differently from the last turn (Qwen3 adds an
empty ``<think>`` block only to the final assistant turn) break the prefix
property; for those the assistant content is located in the full text in order
(see `assistant_char_spans`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional

from ..core.target import render_chat
from ..errors import DeepSpecError
from ..files import iter_jsonl

ROLES = ("user", "assistant")


def with_system_prompt(messages: list[dict], system_prompt: Optional[str]) -> list[dict]:
    """Prepend cfg.data.system_prompt (if any); we never add one otherwise."""
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


def encode_conversation(tokenizer, messages: list[dict], cfg: dict) -> Optional[tuple[list[int], list[bool]]]:
    """Template + mask, truncated at data.max_length; None if it has fewer than
    data.min_loss_tokens loss tokens (the sample is dropped)."""
    d = cfg["data"]
    ids, mask = tokenize_conversation(tokenizer, with_system_prompt(messages, d.get("system_prompt")))
    ids, mask = ids[: d["max_length"]], mask[: d["max_length"]]
    if sum(mask) < d["min_loss_tokens"]:
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
    input_ids: list[int]
    loss_mask: list[bool]


def _id_key(sample_id: str):
    """Natural order of "<source>:<line>" ids (line numerically)."""
    source, _, n = sample_id.rpartition(":")
    return (source, int(n), "") if n.isdigit() else (sample_id, -1, sample_id)


def tokenized_samples(cfg: dict, tokenizer, conversations: str | os.PathLike) -> tuple[list[TokenizedSample], dict]:
    """Tokenise the conversations (chat template + loss mask), in id order, dropping
    samples with fewer than data.min_loss_tokens loss tokens."""
    convs = sorted(read_conversations(conversations), key=lambda c: _id_key(c["id"]))
    out = []
    for c in convs:
        enc = encode_conversation(tokenizer, c["messages"], cfg)
        if enc is not None:
            out.append(TokenizedSample(c["id"], *enc))
    stats = {"conversations": len(convs), "dropped_min_loss_tokens": len(convs) - len(out)}
    if not out:
        raise DeepSpecError(f"{conversations}: no sample has at least data.min_loss_tokens={cfg['data']['min_loss_tokens']} loss tokens")
    return out, stats

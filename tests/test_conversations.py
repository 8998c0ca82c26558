import copy
import dataclasses
import json

import pytest

from deepspec.core.target import render_chat
from deepspec.data.conversations import encode_conversation, read_conversations, tokenize_conversation
from deepspec.errors import DeepSpecError
from deepspec.settings import Settings

TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def _masked(tok, ids, mask):
    return [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]


def test_two_turn_mask_token_by_token(tiny_target):
    tok = tiny_target.tokenizer
    ids, mask = tokenize_conversation(tok, TWO_TURNS)
    assert ids == render_chat(tok, TWO_TURNS, add_generation_prompt=False, tokenize=True)
    pieces = tok.convert_ids_to_tokens(ids)
    # SmolLM2's template: <|im_start|>role\ncontent<|im_end|>\n, with its own default system turn.
    expected = [False] * len(pieces)
    spans = [("Hello", "!", "ĠHow", "Ġcan", "ĠI", "Ġhelp", "?", "<|im_end|>"), ("4", "<|im_end|>")]
    starts = [k for k in range(len(pieces) - 2) if pieces[k : k + 3] == ["<|im_start|>", "ass", "istant"]]
    assert len(starts) == 2
    for start, span in zip(starts, spans):
        first = start + 4  # <|im_start|> ass istant Ċ
        assert tuple(pieces[first : first + len(span)]) == span
        for k in range(first, first + len(span)):
            expected[k] = True
    assert mask == expected
    # the newline after each <|im_end|> and the assistant header are not loss tokens
    assert _masked(tok, ids, mask) == [p for s in spans for p in s]


def test_truncated_turn_has_no_end_of_turn_label(tiny_target):
    """An answer cut at the token limit never produced <|im_end|>: not a label."""
    tok = tiny_target.tokenizer
    turns = copy.deepcopy(TWO_TURNS)
    turns[3]["truncated"] = True
    ids, mask = tokenize_conversation(tok, turns)
    assert ids == tokenize_conversation(tok, TWO_TURNS)[0]  # the rendered text is the same
    assert _masked(tok, ids, mask) == ["Hello", "!", "ĠHow", "Ġcan", "ĠI", "Ġhelp", "?", "<|im_end|>", "4"]


def test_history_rendered_differently_still_masks_content(tiny_target):
    """A Qwen3-like template puts an empty think block only on the last assistant
    turn, so rendered prefixes are not prefixes of the full text."""
    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    ids, mask = tokenize_conversation(tok, TWO_TURNS)
    text = tok.decode([i for i, m in zip(ids, mask) if m])
    assert text == "Hello! How can I help?<|im_end|>4<|im_end|>"


def test_system_prompt_truncation_and_min_loss_tokens(tiny_cfg, tiny_target):
    tok = tiny_target.tokenizer
    data = Settings.of(tiny_cfg).data
    ids, mask = encode_conversation(tok, TWO_TURNS, data)
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ids)  # the template's own default
    ids2, _ = encode_conversation(tok, TWO_TURNS, dataclasses.replace(data, system_prompt="Be terse."))
    assert "Be terse." in tok.decode(ids2) and "named SmolLM" not in tok.decode(ids2)

    data = dataclasses.replace(data, max_length=len(ids) - 3)
    t_ids, t_mask = encode_conversation(tok, TWO_TURNS, data)
    assert t_ids == ids[: len(ids) - 3] and t_mask == mask[: len(ids) - 3]
    assert encode_conversation(tok, TWO_TURNS, dataclasses.replace(data, min_loss_tokens=sum(t_mask) + 1)) is None


def test_bad_conversations_are_one_line_errors(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "a:1", "source": "a", "messages": [{"role": "user", "content": "x"}]}\n{"id": "a:2", "messages": [{"role": "bot", "content": "y"}]}\n')
    with pytest.raises(DeepSpecError, match=r"c.jsonl:2: message 0"):
        read_conversations(p)
    p.write_text('{"id": "a:1", "messages": [{"role": "user", "content": "x"}]}\n{"id": "a:1", "messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(DeepSpecError, match="duplicate"):
        read_conversations(p)
    p.write_text('{"id": "a:1", "mess')
    with pytest.raises(DeepSpecError, match=r"c.jsonl:1: malformed JSON"):
        read_conversations(p)


def test_token_arrays_are_int32_memory_maps_made_once(tmp_path, tiny_cfg, tiny_target, monkeypatch):
    """The conversations are tokenised once into int32 ids + a bool mask +
    int64 offsets in a file every process maps read-only; the samples equal the
    per-conversation tokenisation; a second call (another rank, method or
    resume) maps the same file without tokenising; changed data makes a new file."""
    import numpy as np
    import torch

    from deepspec.data import conversations as C
    from deepspec.data.datasets import OnlineDataset

    from helpers import write_conversations

    path = tmp_path / "regen" / "conversations.jsonl"
    write_conversations(path)
    tok = tiny_target.tokenizer
    # data.min_loss_tokens 12 drops a short sample: the mapped samples skip it too
    settings = Settings.of({**tiny_cfg, "data": {**tiny_cfg["data"], "min_loss_tokens": 12},
                            "cache": {**tiny_cfg["cache"], "mode": "online"}})
    data = settings.data
    arrays, stats = C.tokenized_samples(data, tok, path)
    recs = sorted(read_conversations(path), key=lambda r: C._id_key(r["id"]))
    want = [(r["id"], enc) for r in recs if (enc := encode_conversation(tok, r["messages"], data)) is not None]
    assert 0 < len(want) < len(recs) and stats == {"conversations": len(recs), "dropped_min_loss_tokens": len(recs) - len(want)}
    assert [s.id for s in arrays] == [i for i, _ in want]
    for s, (_, (ids, mask)) in zip(arrays, want):
        assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask
    # storage: one int32 / bool array mapped from the file, samples are views of it
    assert isinstance(arrays.input_ids, np.memmap) and arrays.input_ids.dtype == np.int32
    assert isinstance(arrays.loss_mask, np.memmap) and arrays.loss_mask.dtype == np.bool_
    assert not arrays.input_ids.flags.writeable and arrays.offsets.dtype == np.int64
    assert np.shares_memory(arrays[1].input_ids, arrays.input_ids)
    assert arrays.input_ids.nbytes == 4 * int(arrays.offsets[-1])
    # the online dataset yields the same samples from the mapped arrays
    ds = OnlineDataset(settings, tiny_target, arrays)
    for k, (_, (ids, mask)) in enumerate(want):
        assert ds[k]["input_ids"].tolist() == ids and ds[k]["loss_mask"].tolist() == mask
        assert ds[k]["input_ids"].dtype == torch.long and ds[k]["loss_mask"].dtype == torch.bool

    monkeypatch.setattr(C, "encode_conversation", lambda *a: pytest.fail("tokenised again"))
    again, _ = C.tokenized_samples(data, tok, path)
    assert again.dir == arrays.dir and again.digest == arrays.digest
    assert sorted(p.name for p in path.parent.iterdir() if ".partial" in p.name) == []
    monkeypatch.undo()
    with open(path, "a") as f:  # new data: a new token file, not the stale one
        f.write(json.dumps({"id": "hand:9", "messages": [{"role": "user", "content": "Hi"}, {
            "role": "assistant", "content": "Hello, how are you today, my friend? " * 4}]}) + "\n")
    grown, _ = C.tokenized_samples(data, tok, path)
    assert grown.dir != arrays.dir and len(grown) == len(arrays) + 1 and grown.digest != arrays.digest


def test_tokenize_in_parallel_processes_gives_the_same_arrays(tmp_path, tiny_cfg, tiny_target, monkeypatch):
    """The tokenize rule's pool of processes (NR4) writes the arrays one process
    writes, byte for byte, in the same order; `deepspec tokenize` records where."""
    import numpy as np

    from deepspec.cli import main as cli_main
    from deepspec.data import conversations as C

    from helpers import write_conversations

    path = tmp_path / "regen" / "conversations.jsonl"
    write_conversations(path)
    with open(path, "a") as f:  # enough conversations for several chunks per worker
        for i in range(200):
            f.write(json.dumps({"id": f"more:{i}", "messages": [{"role": "user", "content": f"Count to {i}."}, {
                "role": "assistant", "content": " ".join(str(k) for k in range(i % 40 + 3))}]}) + "\n")
    data = Settings.of(tiny_cfg).data
    tok = tiny_target.tokenizer
    one, two = tmp_path / "one", tmp_path / "two"
    C._write_token_arrays(data, tok, path, one, workers=1)
    C._write_token_arrays(data, tok, path, two, workers=2)
    for name in ("input_ids.npy", "loss_mask.npy", "offsets.npy", "meta.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert len(json.loads((one / "meta.json").read_text())["ids"]) > 150

    out = tmp_path / "tokens.json"
    rc = cli_main(["tokenize", "--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
                   "--conversations", str(path), "--workers", "2", "--out", str(out)])
    rec = json.loads(out.read_text())
    arrays = C.TokenArrays(rec["arrays"])
    assert rc == 0 and rec["samples"] == len(arrays) and rec["digest"] == arrays.digest
    assert np.array_equal(np.load(one / "input_ids.npy"), arrays.input_ids)
    # P8: a training rank with the record maps the arrays without hashing the conversations;
    # a record of another file state (the conversations grown since) is not trusted
    monkeypatch.setattr(C, "sha256_file", lambda *a: pytest.fail("the conversations were hashed again"))
    known, _ = C.tokenized_samples(data, tok, path, record=out)
    monkeypatch.undo()
    assert known.dir == arrays.dir and known.digest == arrays.digest
    with open(path, "a") as f:
        f.write(json.dumps({"id": "late:1", "messages": [{"role": "user", "content": "Hi"}, {
            "role": "assistant", "content": "one two three four five six seven eight nine ten"}]}) + "\n")
    assert C.recorded_token_arrays(data, tok, path, out) is None
    assert C.tokenized_samples(data, tok, path, record=out)[0].dir != arrays.dir

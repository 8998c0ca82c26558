import json

import pytest

from deepspec.data.prompts import check_prompt_length, load_benchmark, read_turns_jsonl, subsample
from deepspec.errors import DeepSpecError


def _write(tmp_path, lines):
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "bad,msg",
    [
        ('{"turns": ["ok"]', "malformed JSON"),
        ('{"prompt": "hi"}', "missing 'turns'"),
        ('{"turns": []}', "non-empty list"),
        ('{"turns": "hi"}', "non-empty list"),
        ('{"turns": [3]}', "turn 0 is not a string"),
        ('{"turns": ["  "]}', "turn 0 is empty"),
        ('["hi"]', "JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, bad, msg):
    p = _write(tmp_path, ['{"turns": ["fine"]}', bad])
    with pytest.raises(DeepSpecError) as e:
        read_turns_jsonl(p)
    text = str(e.value)
    assert f"{p}:2:" in text and msg in text and "\n" not in text


def test_missing_file(tmp_path):
    with pytest.raises(DeepSpecError, match="not found"):
        read_turns_jsonl(tmp_path / "none.jsonl")


def test_subsample_is_reference_rule(tmp_path):
    import random

    rows = read_turns_jsonl(_write(tmp_path, [json.dumps({"turns": [f"q{i}"]}) for i in range(10)]))
    assert subsample(rows, 20) == rows
    expect = list(range(10))
    random.Random(980406).shuffle(expect)
    assert [r.turns[0] for r in subsample(rows, 4)] == [f"q{i}" for i in expect[:4]]
    assert subsample(rows, 4) == subsample(rows, 4)


def test_benchmarks_load_with_caps(tiny_cfg, shared_data):
    rows = load_benchmark(tiny_cfg, "mt-bench")
    assert len(rows) == tiny_cfg["data"]["benchmarks"]["mt-bench"]["cap"]
    assert rows[0].meta["domain"] == "Chat" and len(rows[0].turns) == 2
    with pytest.raises(DeepSpecError, match="unknown benchmark"):
        load_benchmark(tiny_cfg, "nope")


def test_prompt_length_checks():
    with pytest.raises(DeepSpecError, match="empty prompt"):
        check_prompt_length(0, 10, "f:1")
    with pytest.raises(DeepSpecError, match="over the limit"):
        check_prompt_length(11, 10, "f:1")


def test_non_utf8_prompt_file_is_one_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"turns": ["fine"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DeepSpecError, match=r"p\.jsonl:2: not UTF-8 text"):
        read_turns_jsonl(p)

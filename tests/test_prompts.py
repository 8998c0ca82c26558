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


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m", "qwen3-4b"])
def test_default_data_root_is_data_inside_the_repository(preset, monkeypatch, tmp_path):
    """Without DEEPSPEC_DATA and a data.root override a fresh clone reads and
    writes its prompt data under <repo>/data (git-ignored), from any directory."""
    from deepspec.config import REPO_ROOT, load_config
    from deepspec.data.prompts import data_root

    monkeypatch.delenv("DEEPSPEC_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    root = data_root(load_config(preset))
    assert root == REPO_ROOT / "data" and root.is_absolute()
    assert "data/" in (REPO_ROOT / ".gitignore").read_text().splitlines()
    assert data_root(load_config(preset, {"data": {"root": "elsewhere/prompts"}})) == REPO_ROOT / "elsewhere" / "prompts"
    assert data_root(load_config(preset, {"data": {"root": str(tmp_path / "d")}})) == tmp_path / "d"


def test_DEEPSPEC_DATA_overrides_data_root(monkeypatch, tmp_path):
    from deepspec.config import load_config
    from deepspec.data.prompts import data_root

    monkeypatch.setenv("DEEPSPEC_DATA", str(tmp_path / "env"))
    assert data_root(load_config("tiny")) == tmp_path / "env"
    assert data_root(load_config("tiny", {"data": {"root": str(tmp_path / "cfg")}})) == tmp_path / "env"


def test_duplicate_prompt_ids_name_the_id_and_both_files(monkeypatch, tmp_path):
    """F11: two training files of one name in two folders give the same ids
    (<file name stem>:<line>); the error names the id and both files."""
    from deepspec.config import load_config
    from deepspec.data.prompts import load_train_prompts

    for d in ("d1", "d2"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "chat.jsonl").write_text('{"turns": ["hi"]}\n{"turns": ["there"]}\n')
    monkeypatch.setenv("DEEPSPEC_DATA", str(tmp_path))
    cfg = load_config("tiny", {"data": {"train": [{"path": "d1/chat.jsonl"}, {"path": "d2/chat.jsonl"}]}})
    with pytest.raises(DeepSpecError) as e:
        load_train_prompts(cfg)
    assert str(e.value) == ("duplicate prompt id 'chat:1' in d1/chat.jsonl and d2/chat.jsonl "
                            "(ids are <file name stem>:<line>: rename one of the files)")
    cfg = load_config("tiny", {"data": {"train": [{"path": "d1/chat.jsonl"}, {"path": "d1/chat.jsonl"}]}})
    with pytest.raises(DeepSpecError, match=r"'chat:1' in d1/chat\.jsonl and d1/chat\.jsonl \(the source is listed twice\)"):
        load_train_prompts(cfg)
    cfg = load_config("tiny", {"data": {"train": [{"path": "d1/chat.jsonl"}]}})
    assert [p.id for p in load_train_prompts(cfg)] == ["chat:1", "chat:2"]

"""The synthetic competition-math training source (deepspec/data/synthetic.py)."""
import random
import re

import pytest

from deepspec.config import load_config
from deepspec.data.prompts import is_prompt_file, load_sources, read_turns_jsonl
from deepspec.data.synthetic import INSTRUCTION, TEMPLATES, competition_math, synthetic_prompts
from deepspec.errors import DeepSpecError
from deepspec.settings import Settings


def _latex_balanced(text: str) -> bool:
    """Unescaped braces balance and unescaped $ come in pairs (a $$...$$ display counts twice)."""
    body = text.replace("\\{", "").replace("\\}", "").replace("\\$", "")
    depth = 0
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if depth < 0:
            return False
    return depth == 0 and body.count("$") % 2 == 0


@pytest.mark.parametrize("subject,template", [(s, t) for s, ts in TEMPLATES.items() for t in ts],
                         ids=lambda x: getattr(x, "__name__", x))
def test_every_template_writes_well_formed_latex(subject, template):
    for i in range(200):
        text = template(random.Random(i))
        assert text.strip() and "None" not in text, text
        assert _latex_balanced(text), f"{template.__name__}: {text}"


def test_prompts_are_deterministic_prefix_stable_and_spread_over_subjects():
    a, b = competition_math(400, 7), competition_math(800, 7)
    assert a == b[:400]  # a larger cap keeps the smaller cap's prompts
    assert a != competition_math(400, 8)
    subjects = [s for s, _ in a]
    assert set(subjects) == set(TEMPLATES) and min(map(subjects.count, TEMPLATES)) >= 40
    assert all(p.endswith(INSTRUCTION) for _, p in a)
    assert len({p for _, p in b}) == len(b)  # repeats are skipped


def test_source_in_a_preset_and_its_errors():
    cfg = load_config("tiny", {"data": {"train": [{"path": "synthetic:competition-math", "cap": 30}]}})
    rows = load_sources(Settings.of(cfg), cfg["data"]["train"])
    assert [r.id for r in rows] == [f"competition-math:{i}" for i in range(30)]
    assert rows[0].meta["subject"] == "prealgebra" and rows[0].turns == [competition_math(1, cfg["data"]["seed"])[0][1]]
    assert not is_prompt_file("synthetic:competition-math") and is_prompt_file("train/gsm8k_train.jsonl")
    with pytest.raises(DeepSpecError, match="'cap' is a required property"):
        load_config("tiny", {"data": {"train": [{"path": "synthetic:competition-math"}]}})
    with pytest.raises(DeepSpecError, match="data.train.0.path"):
        load_config("tiny", {"data": {"train": [{"path": "synthetic:poetry", "cap": 3}]}})
    with pytest.raises(DeepSpecError, match="unknown synthetic source 'synthetic:poetry'"):
        synthetic_prompts("poetry", 3, 0)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace(INSTRUCTION, "")).strip().lower()


def test_no_problem_repeats_a_benchmark_prompt(shared_data):
    """The contamination checks of the offline training files (docs/DATA.md): no
    generated problem equals a benchmark prompt or contains / is contained in one
    (40 characters or more)."""
    bench = {_normal(t) for f in sorted((shared_data / "eval").glob("*.jsonl"))
             for p in read_turns_jsonl(f) for t in p.turns}
    for _, text in competition_math(2000, 980406):
        q = _normal(text)
        assert q not in bench, text
        assert not any((len(q) >= 40 and q in b) or (len(b) >= 40 and b in q) for b in bench), text


def test_plan_counts_the_generated_prompts():
    from deepspec.planning.plan import data_section

    cfg = load_config("tiny", {"data": {"train": [{"path": "synthetic:competition-math", "cap": 40}]}})
    d = data_section(Settings.of(cfg))
    assert d["train_prompts"] == 40
    assert d["sources"] == [{"path": "synthetic:competition-math", "prompts": 40, "from": "generator"}]
    assert d["prompt_tokens_per_sample"] > 10  # measured on the generated problems


def test_provenance_names_the_generator(shared_data):
    from deepspec.reporting.run_record import _data

    cfg = load_config("tiny", {"data": {"root": str(shared_data),
                                        "train": [{"path": "synthetic:competition-math", "cap": 5}]}})
    rec = _data(Settings.of(cfg))["synthetic:competition-math"]
    assert rec["source"] == "deepspec/data/synthetic.py" and rec["prompts"] == 5 and rec["seed"] == cfg["data"]["seed"]

"""Typed settings (deepspec/settings.py) against the schema they mirror: every
field is a key of its section with the schema's type, every key has a field,
and every preset builds."""
import dataclasses
import typing
from pathlib import Path

import pytest

from deepspec import settings as S
from deepspec.config import SCHEMA_PATH, load_config, load_yaml
from deepspec.errors import DeepSpecError

SCHEMA = load_yaml(SCHEMA_PATH.read_text())
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "config" / "presets").glob("*.yaml"))
PYTHON = {"integer": int, "number": float, "boolean": bool, "string": str, "array": list, "object": typing.Mapping}


def _schema_types(node: dict) -> set:
    """The JSON types a schema node allows (its type, or its alternatives')."""
    if "type" in node:
        t = node["type"]
        return set(t if isinstance(t, list) else [t])
    if "enum" in node:
        return {"string" if all(isinstance(x, str) for x in node["enum"]) else "any"}
    out = set()
    for alt in node.get("oneOf", node.get("anyOf", [])):
        out |= _schema_types(alt)
    return out or {"any"}


def _hint_types(hint) -> set:
    """The Python types a field's annotation allows (None for Optional)."""
    if hint is typing.Any:
        return {"any"}
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:
        return set().union(*(_hint_types(a) for a in args))
    if hint is type(None):
        return {"null"}
    return {next(k for k, v in PYTHON.items() if v is hint)}


@pytest.mark.parametrize("name", sorted(S.SECTIONS))
def test_every_field_is_a_schema_key_of_its_type_and_every_key_a_field(name):
    section = S.SECTIONS[name]
    props = SCHEMA["properties"][name]["properties"]
    fields = {f.name: f for f in dataclasses.fields(section)}
    assert set(fields) == set(props), (sorted(set(fields) - set(props)), sorted(set(props) - set(fields)))
    hints = typing.get_type_hints(section)
    for key, node in props.items():
        want, have = _schema_types(node), _hint_types(hints[key])
        if "any" in have:
            assert len(want) > 1 or "any" in want, f"{name}.{key}: typed Any, but the schema has one type {want}"
            continue
        assert want == have, f"{name}.{key}: schema {sorted(want)}, field {sorted(have)}"
        # a default here is None, for a key the schema may leave out (nullable, no other default)
        f = fields[key]
        if f.default is not dataclasses.MISSING:
            assert f.default is None and "null" in want | have and node.get("default") is None, \
                f"{name}.{key}: a default that is not the schema's"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_builds_typed_settings(preset):
    cfg = load_config(preset)
    s = S.Settings.of(cfg)
    assert s.eval.temperature == cfg["eval"]["temperature"] and isinstance(s.eval.temperature, float)
    assert s.train.global_batch == cfg["train"]["global_batch"] and s.target.name == cfg["target"]["name"]
    assert s.raw is cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.eval.seed = 1


def test_numbers_become_floats_and_nothing_else_changes():
    cfg = load_config("tiny", {"eval": {"temperature": 1}, "train": {"lr": {"eagle3": 1, "dflash": 2e-3, "dspark": 3}}})
    s = S.Settings.of(cfg)
    assert type(s.eval.temperature) is float and type(s.eval.max_new_tokens) is int
    assert s.train.lr == {"eagle3": 1, "dflash": 2e-3, "dspark": 3}  # a per-method map stays the config's


def test_a_key_the_settings_lack_or_a_missing_one_fails_in_one_line():
    cfg = load_config("tiny")
    with pytest.raises(DeepSpecError, match=r"^eval\.bogus: not a setting of Eval"):
        S.Eval.of({**cfg["eval"], "bogus": 1})
    with pytest.raises(DeepSpecError, match=r"^eval\.seed: missing"):
        S.Eval.of({k: v for k, v in cfg["eval"].items() if k != "seed"})

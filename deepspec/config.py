"""Presets as data: YAML files validated by workflow/schemas/config.schema.yaml.

Unknown or ill-typed keys stop with a one-line message naming the key; defaults
(the paper's values) are filled in from the schema.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from .errors import DeepSpecError

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
PRESETS_DIR = REPO_ROOT / "config" / "presets"


def _schema() -> dict:
    if not SCHEMA_PATH.exists():
        raise DeepSpecError(f"config schema not found: {SCHEMA_PATH}")
    return yaml.safe_load(SCHEMA_PATH.read_text())


def deep_merge(base: Mapping, over: Mapping) -> dict:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _fill_defaults(node: Any, schema: Mapping) -> Any:
    """Recursively insert schema defaults for missing object properties."""
    if isinstance(node, dict) and schema.get("type") == "object":
        for key, sub in schema.get("properties", {}).items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                node[key] = _fill_defaults(node[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in node:
                if key not in schema.get("properties", {}):
                    node[key] = _fill_defaults(node[key], extra)
    elif isinstance(node, list) and isinstance(schema.get("items"), Mapping):
        node = [_fill_defaults(x, schema["items"]) for x in node]
    return node


def _where(err) -> str:
    path = ".".join(str(p) for p in err.absolute_path)
    return path or "<top level>"


def validate(cfg: dict, source: str = "config") -> dict:
    """Validate and fill defaults; raise DeepSpecError with the offending key."""
    import jsonschema

    schema = _schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        e = errors[0]
        if e.validator == "additionalProperties":
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            key = ".".join([*map(str, e.absolute_path), extra[0]]) if extra else _where(e)
            raise DeepSpecError(f"{source}: unknown key '{key}'")
        if e.validator == "required":
            raise DeepSpecError(f"{source}: {_where(e)}: {e.message}")
        raise DeepSpecError(f"{source}: invalid value for '{_where(e)}': {e.message}")
    return _fill_defaults(copy.deepcopy(cfg), schema)


def preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = PRESETS_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        known = ", ".join(sorted(x.stem for x in PRESETS_DIR.glob("*.yaml")))
        raise DeepSpecError(f"unknown preset '{name_or_path}' (known: {known})")
    return cand


def parse_set(items: Iterable[str]) -> dict:
    """`key.path=value` overrides (YAML-parsed values) to a nested dict."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise DeepSpecError(f"override '{item}' must look like key.path=value")
        key, val = item.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(val)
    return out


def load_config(preset: str = "smollm2-135m", overrides: Mapping | None = None) -> dict:
    path = preset_path(preset)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DeepSpecError(f"{path}: malformed YAML: {str(e).splitlines()[0]}") from None
    raw.setdefault("preset", path.stem)
    if overrides:
        raw = deep_merge(raw, overrides)
    return validate(raw, source=str(path))


def cli_show_config(argv) -> int:
    from .cli import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec show-config")
    add_config_args(p)
    args = p.parse_args(argv)
    print(json.dumps(config_from_args(args), indent=2))
    return 0

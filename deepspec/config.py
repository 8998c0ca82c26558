"""Presets as data: YAML files validated by workflow/schemas/config.schema.yaml.

Unknown or ill-typed keys stop with a one-line message naming the key; defaults
(the paper's values) are filled in from the schema. Presets and overrides are
read with YAML 1.2 scalars (3e-4 is a number, yes/no are strings), and
Snakemake's `--config` strings are parsed the same way (`coerce_overrides`).

`settings_fingerprint(cfg, rule)` hashes exactly the settings a rule's outputs
depend on (`RULE_SETTINGS`); the rules pass it as a param, so a changed
setting reruns that rule and its descendants and nothing else.
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml

from .errors import DeepSpecError
from .settings import Settings

# DeepSpec runs from its checkout (`pip install -e .`): the presets, the schema and
# the target facts are files of the checkout beside the package, not package data.
REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"
PRESETS_DIR = REPO_ROOT / "config" / "presets"


def _require_checkout() -> None:
    """One line when the package is not inside a checkout (a non-editable `pip install .`)."""
    if not PRESETS_DIR.is_dir() and not SCHEMA_PATH.exists():
        raise DeepSpecError(f"the deepspec package in {REPO_ROOT} is not inside a DeepSpec checkout (no config/presets, "
                            "no workflow/schemas beside it; a non-editable install carries neither): DeepSpec runs "
                            "from its checkout, installed with `pip install -e .`")


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars: floats without a dot
    (3e-4) are numbers and only true/false are booleans. A key given twice in
    one mapping is an error (YAML 1.2 requires unique keys; PyYAML would keep
    the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {seen[key] + 1} and line {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def load_yaml(text: str):
    """YAML with 1.2 scalars (see _Yaml12Loader)."""
    return yaml.load(text, Loader=_Yaml12Loader)


def coerce_overrides(node):
    """Overrides whose leaves may be strings (Snakemake's --config passes
    `{epochs: 2}` and `true` as text): every string is re-read as YAML 1.2."""
    if isinstance(node, dict):
        return {k: coerce_overrides(v) for k, v in node.items()}
    if isinstance(node, list):
        return [coerce_overrides(v) for v in node]
    if isinstance(node, str):
        try:
            value = load_yaml(node)
        except yaml.YAMLError:
            return node
        return coerce_overrides(value) if isinstance(value, (dict, list)) else value
    return node


def _schema() -> dict:
    _require_checkout()
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
    kind = schema.get("type")
    if isinstance(node, dict) and (kind == "object" or isinstance(kind, list) and "object" in kind):
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


def _non_finite(node, path: tuple = ()) -> Optional[tuple[str, float]]:
    """(dotted key, value) of the first NaN or infinity in `node` (YAML's .nan,
    .inf, 1e999), or None."""
    if isinstance(node, float) and not math.isfinite(node):
        return ".".join(map(str, path)) or "<top level>", node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        found = _non_finite(v, (*path, k))
        if found:
            return found
    return None


def validate(cfg: dict, source: str = "config", overrides: Mapping | None = None) -> dict:
    """Validate and fill defaults; raise DeepSpecError with the offending key,
    blamed on `source` (the preset file) or, where `overrides` set that key, on
    the overrides (--set / --config)."""
    import jsonschema

    def fail(key: str, message: str):
        src = OVERRIDES if _sets(overrides, key) else source
        raise DeepSpecError(f"{src}: {message}")

    bad = _non_finite(cfg)  # JSON Schema's number admits them; no setting means anything by them
    if bad:
        fail(bad[0], f"invalid value for '{bad[0]}': {bad[1]} is not a finite number")
    schema = _schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        e = errors[0]
        if e.validator == "additionalProperties":
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            key = ".".join([*map(str, e.absolute_path), extra[0]]) if extra else _where(e)
            fail(key, f"unknown key '{key}'")
        if e.validator == "required":
            fail(_where(e), f"{_where(e)}: {e.message}")
        fail(_where(e), f"invalid value for '{_where(e)}': {e.message}")
    return _fill_defaults(copy.deepcopy(cfg), schema)


OVERRIDES = "overrides (--set / --config)"


def _sets(overrides: Mapping | None, key: str) -> bool:
    """Whether `overrides` (a nested dict) sets dotted `key` or a key above it."""
    node = overrides
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, Mapping):
            return True
    return True


def preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or len(p.parts) > 1:  # a file, not a preset name
        if not p.is_file():
            raise DeepSpecError(f"preset file not found: {name_or_path}")
        return p
    _require_checkout()
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
        try:
            node[parts[-1]] = load_yaml(val)
        except yaml.YAMLError as e:
            raise DeepSpecError(f"override '{item}': malformed YAML value ({str(e).splitlines()[0]})") from None
    return out


def _read_preset(path: Path) -> dict:
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise DeepSpecError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise DeepSpecError(f"{path}: malformed YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise DeepSpecError(f"{path}: a preset is a mapping of keys, not {type(raw).__name__}")
    return raw


def resolve_base(path: Path, raw: dict, seen: tuple = ()) -> dict:
    """A preset with `base: NAME` is NAME's preset (itself resolved) deep-merged
    with its own keys; lists and scalars replace the base's. The result has no
    `base` key. A cycle or an unknown base is one line naming the preset."""
    raw = dict(raw)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise DeepSpecError(f"{path}: invalid value for 'base': a preset name, not {base!r}")
    try:
        base_path = preset_path(base)
    except DeepSpecError as e:
        raise DeepSpecError(f"{path}: base: {e}") from None
    chain = (*seen, path.resolve())
    if base_path.resolve() in chain:
        names = " -> ".join(p.stem for p in (*chain, base_path))
        raise DeepSpecError(f"{path}: base presets form a cycle ({names})")
    inherited = resolve_base(base_path, _read_preset(base_path), chain)
    inherited.pop("preset", None)  # the preset's own name, never its base's
    return merge_layer(inherited, raw)


def merge_layer(below: Mapping, above: Mapping) -> dict:
    """`deep_merge`, except that a target's revision belongs to its spec: a layer
    (a preset over its base, overrides over the preset) that names another
    target.spec without a target.revision drops the revision beneath it, which
    would pin a commit of another repository."""
    t, bt = above.get("target"), below.get("target")
    if (isinstance(t, Mapping) and "spec" in t and "revision" not in t and isinstance(bt, Mapping)
            and bt.get("spec") != t["spec"] and "revision" in bt):
        below = {**below, "target": {k: v for k, v in bt.items() if k != "revision"}}
    return deep_merge(below, above)


def load_config(preset: str = "smollm2-135m", overrides: Mapping | None = None) -> dict:
    path = preset_path(preset)
    raw = resolve_base(path, _read_preset(path))
    raw.setdefault("preset", path.stem)
    if overrides and "base" in overrides:
        raise DeepSpecError(f"override 'base': a preset's base is set in the preset file ({path}), not by an override")
    if overrides:
        raw = merge_layer(raw, overrides)
    return validate(raw, source=str(path), overrides=overrides)


# The settings each rule's outputs depend on (dotted paths into the preset).
# Left out: where files live (results_dir, data.root, ...), scheduler resources,
# and execution-only keys (server URLs, concurrency, timeouts, retries,
# checkpoint cadence, GPU counts), which do not change what a rule computes.
_TARGET = ["target.spec", "target.revision", "target.dtype"]
# what decoding (and regeneration's sampling) also depends on: the CPU linear-layer kernels
# (oneDNN's packed matmuls or torch's) round differently, by up to ~4e-6 in the records'
# probabilities (probe-3, C8)
_DECODE = _TARGET + ["target.cpu_matmul"]
_TOKENS = ["data.max_length", "data.min_loss_tokens", "data.system_prompt"]
# What a target cache's bytes depend on besides the target and the token data:
# {name in the cache's fingerprint (deepspec.data.cache.data_fingerprint): dotted path}.
CACHE_BYTES_SETTINGS = {
    "revision": "target.revision", "target_dtype": "target.dtype", "layers": "target.feature_layers",
    "dtype": "cache.dtype", "shard_tokens": "cache.shard_tokens", "batch_size": "cache.batch_size",
}
RULE_SETTINGS = {
    "prepare_target": ["target.spec", "target.revision"],
    # target.cpu_matmul: the local backend samples a bf16 target on oneDNN-packed weights
    # only with onednn (regeneration/local.py:sampling_kernels), so its tokens depend on it
    "regenerate": _DECODE + ["data.train", "data.seed", "data.system_prompt", "data.max_prompt_tokens", "regenerate"],
    "tokenize": ["target.spec", "target.revision", *_TOKENS],
    # drafter.draft_vocab_size: whether the cache holds target_lse (cache.stores_log_normalizers)
    "build_cache": ["target.spec", *CACHE_BYTES_SETTINGS.values(), "cache.precision", "drafter.draft_vocab_size",
                    *_TOKENS],
    "train": _TARGET + ["target.feature_layers", *_TOKENS, "cache", "drafter", "loss", "train"],
    "evaluate": _DECODE + ["target.feature_layers", "data.benchmarks", "data.seed", "data.max_prompt_tokens", "eval"],
    "baseline": _DECODE + ["data.benchmarks", "data.seed", "data.max_prompt_tokens", "eval.dtype", "eval.precision",
                           "eval.temperature",
                           "eval.max_new_tokens", "eval.seed", "eval.baselines", "eval.prompt_lookup_num_tokens",
                           "eval.speed_prompts", "eval.speed_benchmarks"],
    "schedule": _TARGET + ["data.max_length", "eval", "ablations.thresholds"],
    "report": ["preset", "description", "target", "data.benchmarks", "drafter", "train", "eval", "serve.engine"],
    "ablation": ["data.benchmarks", "drafter", "train.max_steps", "eval", "ablations"],
    "throughput": _DECODE + ["target.feature_layers", "data.benchmarks", "data.seed", "data.max_prompt_tokens",
                             "eval.dtype", "eval.precision", "eval.temperature", "eval.seed", "eval.released_checkpoints",
                             "throughput"],
    "fig7": ["target.name"],
    "serve_check": _DECODE + ["target.feature_layers", "data.benchmarks", "data.seed", "data.max_prompt_tokens",
                              "eval", "serve.greedy_prompts"],
}
EXECUTION_KEYS = {"regenerate.urls", "regenerate.server", "regenerate.connect_timeout_s", "regenerate.concurrency", "regenerate.shards", "regenerate.request_timeout_s",
                  "regenerate.max_retries", "regenerate.retry_backoff_s", "regenerate.max_failed_fraction", "cache.mode", "train.checkpoint_every",
                  "train.checkpoint_minutes", "train.shard_optimizer",
                  "train.keep_checkpoints", "train.gpus", "train.processes", "train.nodes",
                  "train.main_process_port", "train.start_first", "train.chunk_positions", "eval.gpus",
                  "eval.baseline_jobs", "serve.vllm_python", "serve.kv_cache_gb"}


@functools.lru_cache(maxsize=1)
def _schema_for_lookup() -> dict:
    """The schema, read once, for `schema_node` (never mutated)."""
    return _schema()


def schema_node(dotted: str) -> Optional[dict]:
    """The schema of the config key at `dotted` (e.g. "train.lr"), or None when
    the schema has no such key."""
    node = _schema_for_lookup()
    for part in dotted.split("."):
        props = node.get("properties", {})
        if part in props:
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _may_be_absent(dotted: str) -> bool:
    """True when a validated config can lack `dotted`: the schema leaves the key
    (or one of its parents) optional without a default."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        parent = _schema_for_lookup() if i == 0 else schema_node(".".join(parts[:i]))
        sub = schema_node(".".join(parts[:i + 1]))
        if parent is None or sub is None:
            return False
        if part not in parent.get("required", []) and "default" not in sub:
            return True
    return False


def as_config(cfg: Settings | Mapping) -> Mapping:
    """The validated config itself, as the preset wrote it: what rule settings and
    their fingerprints are computed over (a typed Settings carries it as `raw`)."""
    return cfg.raw if isinstance(cfg, Settings) else cfg


def pick(cfg: Settings | Mapping, dotted: str):
    """The value at dotted path `dotted` of a validated config. A path the schema
    does not have is an error (a misspelled RULE_SETTINGS entry would otherwise
    fingerprint None and never rerun its rule); a key the schema leaves optional
    without a default reads as None when absent."""
    if schema_node(dotted) is None:
        raise DeepSpecError(f"config key '{dotted}' is not in {SCHEMA_PATH.name}")
    node = as_config(cfg)
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if _may_be_absent(dotted):
                return None
            raise DeepSpecError(f"config key '{dotted}' is missing (the config was not validated)")
        node = node[part]
    return node


def unknown_setting_paths() -> list[str]:
    """The RULE_SETTINGS and EXECUTION_KEYS paths that are not in the schema."""
    paths = {p for keys in RULE_SETTINGS.values() for p in keys} | set(EXECUTION_KEYS)
    return sorted(p for p in paths if schema_node(p) is None)


def _drop_execution_keys(node, prefix: str):
    if not isinstance(node, dict):
        return node
    return {k: _drop_execution_keys(v, f"{prefix}.{k}") for k, v in node.items() if f"{prefix}.{k}" not in EXECUTION_KEYS}


def rule_settings(cfg: Settings | Mapping, rule: str) -> dict:
    """The part of the (validated) config that rule `rule` depends on."""
    unknown = unknown_setting_paths()
    if unknown:
        raise DeepSpecError(f"RULE_SETTINGS / EXECUTION_KEYS name keys that are not in {SCHEMA_PATH.name}: "
                            + ", ".join(unknown))
    return {key: _drop_execution_keys(pick(cfg, key), key) for key in RULE_SETTINGS[rule]}


def settings_fingerprint(cfg: Settings | Mapping, rule: str) -> str:
    """sha256 (16 hex digits) of `rule_settings`, canonical JSON."""
    blob = json.dumps(rule_settings(cfg, rule), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="preset name (config/presets) or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset key, e.g. --set train.lr=3e-4 (repeatable)")


def config_from_args(args: argparse.Namespace) -> dict:
    return load_config(args.preset, parse_set(args.overrides))

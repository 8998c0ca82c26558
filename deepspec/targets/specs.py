"""Architecture facts of the paper targets (config/targets/<name>.json: the
fields of their hub config.json, with `deepspec_source` citing where they were
read), so that `plan` and the GPU check can build a weightless or random-weight
target of the real dimensions offline; checked against the hub's config.json
when it is reachable.

`known_config` is the one reader of a target's config.json fields without
loading the target (plan, preflight, the cache estimate); this module imports
no torch, so that the plan-time checks stay light.
"""
from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path
from typing import Mapping, Optional

from ..architectures import check_model_type
from ..config import REPO_ROOT
from ..errors import DeepSpecError
from ..paths import RunPaths
from ..runtime import hub_offline
from ..settings import Settings

log = logging.getLogger(__name__)

FACTS_DIR = REPO_ROOT / "config" / "targets"
SOURCE_KEY = "deepspec_source"
COMPARED_SKIP = {SOURCE_KEY, "torch_dtype", "dtype", "transformers_version", "use_cache"}


def facts_path(name: str) -> Path:
    return FACTS_DIR / f"{name}.json"


def known_config(cfg: Settings | Mapping) -> tuple[Optional[dict], str]:
    """(config.json fields, where they come from) of the preset's target, known
    without loading it: the prepared checkpoint's config.json, the shipped facts
    (by target name, then by builtin spec), or a builtin tiny spec's config (with
    SmolLM2's vocabulary); (None, "") when none of them knows it."""
    s = Settings.view(cfg)
    t = s.target
    prepared = RunPaths.of(s).target_checkpoint() / "config.json"
    if prepared.exists():
        return json.loads(prepared.read_text()), str(prepared)
    shipped = facts_path(t.name)
    for path in (shipped, facts_path(t.spec) if "/" not in t.spec else shipped):  # by name, then builtin spec
        if path.exists():
            return json.loads(path.read_text()), str(path.relative_to(REPO_ROOT))
    from .tiny import TINY_SPECS, tiny_config

    if t.spec in TINY_SPECS:
        base = json.loads(facts_path("smollm2-135m").read_text())  # the tiny targets use SmolLM2's tokenizer
        c = tiny_config(TINY_SPECS[t.spec], vocab_size=base["vocab_size"], bos_token_id=base["bos_token_id"],
                        eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"])
        return c.to_dict(), "deepspec/targets/tiny.py:tiny_config (vocabulary of SmolLM2)"
    return None, ""


def text_fields(fields: dict) -> dict:
    """The text decoder's fields of a config.json (a multimodal wrapper's text_config)."""
    return fields.get("text_config") or fields


def text_dims(cfg: Settings | Mapping, download: bool = False) -> Optional[dict]:
    """The target's text-decoder config fields without loading its weights:
    `known_config`, else the hub's config.json of target.spec (from the local hub
    cache only unless `download`); None when it cannot be known."""
    s = Settings.view(cfg)
    fields, _ = known_config(s)
    if fields is not None:
        return text_fields(fields)
    from transformers import AutoConfig

    t = s.target
    try:
        return AutoConfig.from_pretrained(t.spec, revision=t.revision,
                                          local_files_only=not download).get_text_config().to_dict()
    except Exception:
        if download:
            raise
        return None  # not cached here: checked when the target is loaded


def load_facts(cfg: Settings | Mapping) -> tuple[dict, str]:
    """(config.json fields, where they come from) of the preset's target (`known_config`)."""
    s = Settings.view(cfg)
    facts, where = known_config(s)
    if facts is not None:
        return facts, where
    t = s.target
    raise DeepSpecError(f"plan: no architecture facts for target {t.name!r}: add "
                        f"{facts_path(t.name).relative_to(REPO_ROOT)} (the fields of {t.spec}'s config.json) "
                        "or prepare the target first")


def _hub_reachable(timeout: float = 2.0) -> bool:
    if hub_offline():
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def compare_facts(shipped: dict, real: dict, prefix: str = "") -> list[str]:
    """Fields of `shipped` whose value differs in `real` (nested dicts compared field by field)."""
    diffs = []
    for key, want in shipped.items():
        if key in COMPARED_SKIP:
            continue
        have = real.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            diffs += compare_facts(want, have, f"{prefix}{key}.")
        elif have != want and not (isinstance(want, (int, float)) and isinstance(have, (int, float)) and math.isclose(want, have)):
            diffs.append(f"{prefix}{key}: shipped {want!r}, hub {have!r}")
    return diffs


def check_against_hub(facts: dict, spec: str, offline: bool = False) -> dict:
    """Compare the shipped facts with the hub's config.json of `spec` when the
    hub is reachable; offline: skipped with one log line."""
    if offline or not _hub_reachable():
        log.info("hub not reachable (offline): architecture facts of %s not checked against its config.json", spec)
        return {"checked": False, "reason": "offline"}
    from huggingface_hub import hf_hub_download

    try:
        real = json.loads(Path(hf_hub_download(spec, "config.json")).read_text())
    except Exception as e:  # noqa: BLE001 - any hub failure leaves the plan usable
        log.warning("could not read %s's config.json from the hub (%s): facts not checked", spec, str(e).splitlines()[0])
        return {"checked": False, "reason": str(e).splitlines()[0]}
    diffs = compare_facts(facts, real)
    for d in diffs:
        log.warning("architecture facts of %s differ from the hub: %s", spec, d)
    return {"checked": True, "differences": diffs}


def target_config(facts: dict):
    """A transformers config of the target's text decoder from its facts."""
    from transformers import AutoConfig

    fields = {k: v for k, v in facts.items() if k != SOURCE_KEY}
    if isinstance(fields.get("text_config"), dict):  # multimodal wrapper: plan its decoder
        fields = dict(fields["text_config"], tie_word_embeddings=fields.get("tie_word_embeddings", True))
    model_type = fields.get("model_type")
    check_model_type(model_type, "the target's architecture facts")
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype",
                                                             "transformers_version", "_name_or_path")}
    return AutoConfig.for_model(model_type, **fields)


def meta_target(cfg: Settings | Mapping, facts: dict, dtype=None):
    """A random-weight target (core.target.Target) of the preset's architecture
    on the meta device, in `dtype` (bfloat16 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..core.target import Target, eos_ids

    dtype = torch.bfloat16 if dtype is None else dtype

    config = target_config(facts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id=Settings.view(cfg).target.spec,
                  eos_token_ids=eos_ids(config.eos_token_id))

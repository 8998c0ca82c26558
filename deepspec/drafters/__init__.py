"""Drafters: Eagle3, DFlash, DSpark (paper Sec. 3-4; docs/INTERFACES.md), one
per file: `eagle3.py`, `dflash.py`, `dspark.py` (MarkovHead, ConfidenceHead);
`base.py` is what they share and `blocks.py` the transformers building blocks
per target architecture.

build_drafter(method, target, cfg) -> a fresh drafter attached to `target`
    (shared frozen embedding / LM head; init_from_target copies the last k
    target layers; reduced vocab: call `drafter.set_draft_vocab(counts)`, or
    pass `token_counts=` here, with counts from `count_tokens`).
load_drafter(path, target, drafter_cfg=None) -> a saved drafter, checked against
    `target` (DeepSpecError on a different target id, vocab or hidden size),
    given the config's `drafter` section against its drafter.layer_arch (a
    drafter of other draft layers than the config builds is refused), and
    against its own config.json (`check_weights`: every tensor the config
    implies is in the weights file with the shape it implies, and every loaded
    value is finite; nothing is initialised at random). Reading the config
    (`read_drafter_config`) and building the drafter it describes fail in one
    line naming config.json and the key, whatever transformers raises (its
    strict-dataclass validators raise no ValueError).
"""
from __future__ import annotations

import contextlib
import json
from typing import Mapping

from ..errors import DeepSpecError, first_line
from ..settings import Drafter, Settings
from .base import (  # noqa: F401
    METHODS,
    check_layer_arch,
    check_target_match,
    count_tokens,
    draft_config,
    read_config_json,
    read_method,
)
from .dflash import DFlashDrafter
from .dspark import DSparkDrafter
from .eagle3 import Eagle3Drafter

CLASSES = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}


def build_drafter(method: str, target, cfg: Settings | Mapping, token_counts=None):
    s = Settings.view(cfg)
    if method not in CLASSES:
        raise DeepSpecError(f"unknown drafter method {method!r}: use one of {', '.join(METHODS)}")
    config = draft_config(method, target, s.drafter, s.target.feature_layers)
    model = CLASSES[method](config).to(target.device)
    model.attach_target(target)
    if config.deepspec_draft_vocab_size is not None and token_counts is not None:
        model.set_draft_vocab(token_counts)
    freeze_mask_embedding(model, target, init=True)
    if s.drafter.init_from_target:
        if config.num_hidden_layers > target.num_layers:
            raise DeepSpecError(
                f"init_from_target: {config.num_hidden_layers} draft layers but the target has {target.num_layers}"
            )
        model.init_layers_from_target(target, model.layers, model.norm)
    return model


def load_drafter(path, target, drafter_cfg: Drafter | Mapping | None = None):
    from safetensors import SafetensorError

    method = read_method(path)
    config = read_drafter_config(path)
    try:
        check_target_match(config, target, where=f"drafter at {path}")
        if drafter_cfg is not None:
            check_layer_arch(config, target, drafter_cfg, where=f"drafter at {path}")
    except DeepSpecError:
        raise
    except Exception as e:  # a value of a type the checks cannot compare: one line naming the key
        raise _config_error(path, e) from None
    try:
        check_weights(path, CLASSES[method], config, target)
        model = CLASSES[method].from_pretrained(str(path), config=config)
    except DeepSpecError:
        raise
    except (OSError, SafetensorError) as e:  # missing / truncated weights
        first = first_line(e)
        raise DeepSpecError(f"cannot load the drafter at {path}: {first}") from None
    except Exception as e:  # the config describes a drafter transformers cannot build
        raise _config_error(path, e) from None
    model = model.to(target.device)  # a device error is its own, not the config's
    check_finite(path, model)
    model.attach_target(target)
    freeze_mask_embedding(model, target, init=False)
    return model.eval()


# The checks of a drafter config.json's own fields, by key (a value `draft_config`
# cannot have written is refused as one line naming the key, before anything is built):
# deepspec_* fields and the sizes that shape the draft layers, each where present.
_POSITIVE = ("deepspec_target_vocab_size", "deepspec_target_hidden_size", "deepspec_target_num_layers",
             "deepspec_block_size", "deepspec_ttt_length", "num_hidden_layers", "hidden_size",
             "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
             "num_global_key_value_heads", "deepspec_draft_vocab_size")
_NULLABLE = ("deepspec_draft_vocab_size", "deepspec_mask_token_id", "num_key_value_heads", "head_dim",
             "global_head_dim", "num_global_key_value_heads")
_BOOLS = ("deepspec_confidence_head", "deepspec_confidence_with_markov")
_CHOICES = {"deepspec_markov_head_type": ("vanilla", "rnn")}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_problem(key: str, v) -> str | None:
    """What is wrong with config.json's value `v` for `key`, or None."""
    import torch

    if v is None and key in _NULLABLE:
        return None
    if key in _POSITIVE and not (_is_int(v) and v > 0):
        return "a positive integer"
    if key in ("deepspec_markov_rank", "deepspec_mask_token_id") and not (_is_int(v) and v >= 0):
        return "an integer >= 0"
    if key == "deepspec_feature_layers" and not (isinstance(v, list) and v and all(_is_int(x) for x in v)):
        return "a list of layer indices"
    if key == "model_type" and not (isinstance(v, str) and v):
        return "the name of a transformers model type"
    if key in _BOOLS and not isinstance(v, bool):
        return "true or false"
    if key in _CHOICES and v not in _CHOICES[key]:
        return f"one of {', '.join(_CHOICES[key])}"
    if key in ("dtype", "torch_dtype") and v is not None and not (
            isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype)):
        return "a torch dtype name (float32, bfloat16, ...)"
    return None


def read_drafter_config(path):
    """A saved drafter's config.json as its transformers config class, each failure one
    line naming the file and the key: a value of the wrong type or range (`_field_problem`),
    or one the config class's validators refuse (e.g. Qwen3's `num_hidden_layers` against
    `layer_types`, a hidden size no multiple of the heads), never their multi-line traceback."""
    from pathlib import Path

    from transformers import AutoConfig

    cfg_file = Path(path) / "config.json"
    raw = read_config_json(path)
    for key, v in raw.items():
        want = _field_problem(key, v)
        if want:
            raise DeepSpecError(f"{cfg_file}: {key} is {json.dumps(v)}, but it must be {want}")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # huggingface_hub's StrictDataclassError (not a ValueError), ValueError, ...
        raise _config_error(path, e, raw) from None


def _config_error(path, e: BaseException, raw: dict | None = None) -> DeepSpecError:
    """One line for a drafter config transformers refused (or could not build a drafter
    of): the file, the config.json keys the reason names, and that reason. A strict
    dataclass validation error's first line only says which validator failed; its
    cause is on the last."""
    import re
    from pathlib import Path

    cfg_file = Path(path) / "config.json"
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
    field = re.match(r"Validation error for field '(\w+)'", lines[0])
    reason = lines[-1] if re.match(r"(Class )?[Vv]alidation error for", lines[0]) and len(lines) > 1 else lines[0]
    reason = re.sub(r"^\w+(Error|Exception): ", "", reason) or type(e).__name__
    if raw is None:
        with contextlib.suppress(DeepSpecError):
            raw = read_config_json(path)
    keys = [field.group(1)] if field else _keys_named(reason, raw or {})
    named = f"config {', '.join(keys)}" if keys else "no key named"
    return DeepSpecError(f"{cfg_file}: not a valid drafter config ({named}): {reason}")


def _keys_named(text: str, raw: dict) -> list:
    """The keys of `raw` that `text` names, as written (`num_hidden_layers`) or in words
    ("hidden size", "attention heads" for num_attention_heads), in the order it names them;
    failing that, the keys whose string value it quotes."""
    import re

    found = {}
    for k in raw:
        m = re.search(rf"(?<!\w){re.escape(k)}(?!\w)", text)
        words = re.sub(r"^num_", "", k).replace("_", " ")
        if m is None and " " in words:
            m = re.search(rf"(?<!\w){re.escape(words)}(?!\w)", text, re.I)
        if m is not None:
            found[k] = m.start()
    if not found:  # else a string value it quotes (transformers' KeyError of an unknown hidden_act, e.g.)
        found = {k: text.find(q) for k, v in raw.items() if isinstance(v, str) and v
                 for q in (f"'{v}'", f'"{v}"', f"`{v}`") if q in text}
    return sorted(found, key=found.get)


def freeze_mask_embedding(model, target, init: bool) -> None:
    """Block drafters with a reserved mask token (drafter.mask_token_id; Qwen3 151669,
    Gemma4 4, as the reference): the mask input is the target's frozen embedding of
    that token (module output, so Gemma4's sqrt(d) scale included), set at build
    time (`init`) and never trained, so that exports name the token exactly."""
    mid = getattr(model.config, "deepspec_mask_token_id", None)
    if mid is None or not hasattr(model, "mask_embedding"):
        return
    if not 0 <= mid < target.vocab_size:
        raise DeepSpecError(f"drafter.mask_token_id {mid} is outside the target vocabulary ({target.vocab_size})")
    if init:
        import torch

        with torch.no_grad():
            ids = torch.tensor([mid], device=target.embed_tokens.weight.device)
            model.mask_embedding.copy_(target.embed_tokens(ids)[0].to(model.mask_embedding))
    model.mask_embedding.requires_grad_(False)


def _stored_shapes(path) -> dict:
    """{tensor name: (shape, file name)} of a saved drafter's safetensors (one file, or shards with an index)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    d = Path(path)
    index = d / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DeepSpecError(f"{index}: malformed index (no weight_map)") from None
    out = {}
    for name in files:
        if not (d / name).exists():
            raise DeepSpecError(f"cannot load the drafter at {path}: {name} is missing")
        with safe_open(str(d / name), framework="pt") as f:
            for k in f.keys():
                out[k] = (tuple(f.get_slice(k).get_shape()), name)
    return out


def _config_keys_for(config, dims) -> str:
    """The config.json keys whose value is one of `dims` (what implies a tensor's size)."""
    keys = sorted({k for k, v in config.to_dict().items()
                   if isinstance(v, int) and not isinstance(v, bool) and v > 1 and v in dims})
    return ", ".join(keys) if keys else "its sizes"


def _keys_off_target(config, target) -> list:
    """The size fields of a drafter config that differ from the draft config deepspec
    builds for `target` with the drafter's own deepspec_* settings (`draft_config`):
    the keys a tampered config.json changed (to name them when a tensor's shape is off)."""
    if target is None:
        return []
    try:
        from .base import draft_config

        c = config
        arch = "qwen3" if c.model_type == "qwen3" and target.text_config.model_type != "qwen3" else "target"
        d = dict(num_layers={c.deepspec_method: c.num_hidden_layers}, block_size=c.deepspec_block_size,
                 ttt_length=c.deepspec_ttt_length, markov_rank=c.deepspec_markov_rank,
                 markov_head_type=c.deepspec_markov_head_type, confidence_head=c.deepspec_confidence_head,
                 confidence_with_markov=c.deepspec_confidence_with_markov, init_from_target=False, layer_arch=arch,
                 draft_vocab_size=c.deepspec_draft_vocab_size, mask_token_id=c.deepspec_mask_token_id)
        want = draft_config(c.deepspec_method, target, d, c.deepspec_feature_layers).to_dict()
    except Exception:  # noqa: BLE001 -- only a hint for the message
        return []
    have = config.to_dict()
    return sorted(k for k, v in have.items() if _is_int(v) and _is_int(want.get(k)) and v != want[k])


def check_weights(path, cls, config, target=None) -> None:
    """Every parameter and persistent buffer the drafter `config` describes is
    in the weights file under its name and with its shape: one line naming the
    file, the tensor and the config key otherwise (transformers would initialise
    a missing tensor at random and report a mismatch as a multi-line table)."""
    import re

    import torch

    stored = _stored_shapes(path)
    # the draft depth first (a config with a layer more or less names the key, and a
    # tampered huge depth is not built): the layers the weights file holds
    n, have = config.num_hidden_layers, sorted({int(m.group(1)) for k in stored if (m := re.match(r"layers\.(\d+)\.", k))})
    if have and n != len(have):
        raise DeepSpecError(f"{path}/config.json: num_hidden_layers is {n}, but the weights file has {len(have)} draft "
                            f"layers (layers.{have[0]} to layers.{have[-1]}): the weights and config.json do not belong "
                            "together (retrain or re-export)")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    missing = [k for k in expected if k not in stored]
    other = _method_of_weights(config, cls, stored) if missing or set(stored) - set(expected) else None
    if other:
        raise DeepSpecError(f"{path}/config.json: deepspec_method is {config.deepspec_method!r}, but the weights file "
                            f"holds the tensors of the {other} method" + (f" ({missing[0]} is not in it)" if missing else "")
                            + ": the weights and config.json do not belong together (retrain or re-export)")
    if missing:
        k = missing[0]
        layer = re.match(r"(?:.*\.)?layers\.(\d+)\.", k)
        key = "num_hidden_layers" if layer and not any(f"layers.{layer.group(1)}." in s for s in stored) \
            else _config_keys_for(config, expected[k])
        extra = sorted(set(stored) - set(expected))
        more = f" ({len(missing)} tensors missing" + (f"; the file has {len(extra)} the config does not describe, "
                                                         f"e.g. {extra[0]}" if extra else "") + ")"
        raise DeepSpecError(f"{path}/config.json: {k} is not in the weights file, but the drafter its config "
                            f"describes has it (config {key}){more if len(missing) > 1 or extra else ''}: "
                            "the weights and config.json do not belong together (retrain or re-export)")
    for k, shape in expected.items():
        if stored[k][0] != shape:
            found, name = stored[k]
            key = ", ".join(_keys_off_target(config, target)) or _config_keys_for(config, set(shape) - set(found) or set(shape))
            raise DeepSpecError(f"{path}/{name}: {k} is {list(found)}, but config.json ({key}) implies "
                                f"{list(shape)}: the weights and config.json do not belong together")


def _method_of_weights(config, cls, stored) -> str | None:
    """The other drafter method whose drafter of `config` has exactly the stored tensors
    (a config.json whose deepspec_method was changed), or None."""
    import torch

    for method, other in CLASSES.items():
        if other is cls:
            continue
        try:
            with torch.device("meta"):
                if set(other(config).state_dict()) == set(stored):
                    return method
        except Exception:  # noqa: BLE001 -- a config that other method cannot build: not its weights
            continue
    return None


def check_finite(path, model) -> None:
    """Every loaded floating parameter and buffer is finite (a NaN or inf weight,
    e.g. from a diverged run, is refused here rather than evaluated or exported)."""
    import torch

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not torch.isfinite(t).all():
            n = int((~torch.isfinite(t)).sum())
            source = (getattr(model.config, "deepspec_source", None) or {}).get("checkpoint")
            advice = (f": it was converted from {source}; check that checkpoint and convert it again" if source
                      else " (a diverged or corrupted training run); retrain it")
            raise DeepSpecError(f"{path}: {name} has {n} non-finite value(s) (NaN or inf): the drafter is damaged{advice}")

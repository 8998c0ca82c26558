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
    value is finite; nothing is initialised at random).
"""
from __future__ import annotations

from typing import Mapping

from ..errors import DeepSpecError
from ..settings import Drafter, Settings
from .base import METHODS, check_layer_arch, check_target_match, count_tokens, draft_config, read_method  # noqa: F401
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
    from transformers import AutoConfig

    method = read_method(path)
    try:
        config = AutoConfig.from_pretrained(str(path))
        check_target_match(config, target, where=f"drafter at {path}")
        if drafter_cfg is not None:
            check_layer_arch(config, target, drafter_cfg, where=f"drafter at {path}")
        check_weights(path, CLASSES[method], config)
        model = CLASSES[method].from_pretrained(str(path), config=config).to(target.device)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:  # missing / truncated weights, bad config
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DeepSpecError(f"cannot load the drafter at {path}: {first}") from None
    check_finite(path, model)
    model.attach_target(target)
    freeze_mask_embedding(model, target, init=False)
    return model.eval()


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
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
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


def check_weights(path, cls, config) -> None:
    """Every parameter and persistent buffer the drafter `config` describes is
    in the weights file under its name and with its shape: one line naming the
    file, the tensor and the config key otherwise (transformers would initialise
    a missing tensor at random and report a mismatch as a multi-line table)."""
    import re

    import torch

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    stored = _stored_shapes(path)
    missing = [k for k in expected if k not in stored]
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
            key = _config_keys_for(config, set(shape) - set(found) or set(shape))
            raise DeepSpecError(f"{path}/{name}: {k} is {list(found)}, but config.json ({key}) implies "
                                f"{list(shape)}: the weights and config.json do not belong together")


def check_finite(path, model) -> None:
    """Every loaded floating parameter and buffer is finite (a NaN or inf weight,
    e.g. from a diverged run, is refused here rather than evaluated or exported)."""
    import torch

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not torch.isfinite(t).all():
            n = int((~torch.isfinite(t)).sum())
            raise DeepSpecError(f"{path}: {name} has {n} non-finite value(s) (NaN or inf): the drafter is damaged "
                                "(a diverged or corrupted training run); retrain it")

"""Drafters: Eagle3, DFlash, DSpark (paper Sec. 3-4; docs/INTERFACES.md), one
per file: `eagle3.py`, `dflash.py`, `dspark.py` (MarkovHead, ConfidenceHead);
`base.py` is what they share and `blocks.py` the transformers building blocks
per target architecture.

build_drafter(method, target, cfg) -> a fresh drafter attached to `target`
    (shared frozen embedding / LM head; init_from_target copies the last k
    target layers; reduced vocab: call `drafter.set_draft_vocab(counts)`, or
    pass `token_counts=` here, with counts from `count_tokens`).
load_drafter(path, target, drafter_cfg=None) -> a saved drafter, checked against
    `target` (DeepSpecError on a different target id, vocab or hidden size) and,
    given the config's `drafter` section, against its drafter.layer_arch (a
    drafter of other draft layers than the config builds is refused).
"""
from __future__ import annotations

from ..errors import DeepSpecError
from .base import METHODS, check_layer_arch, check_target_match, count_tokens, draft_config, read_method  # noqa: F401
from .dflash import DFlashDrafter
from .dspark import DSparkDrafter
from .eagle3 import Eagle3Drafter

CLASSES = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}


def build_drafter(method: str, target, cfg: dict, token_counts=None):
    if method not in CLASSES:
        raise DeepSpecError(f"unknown drafter method {method!r}: use one of {', '.join(METHODS)}")
    config = draft_config(method, target, cfg)
    model = CLASSES[method](config).to(target.device)
    model.attach_target(target)
    if config.deepspec_draft_vocab_size is not None and token_counts is not None:
        model.set_draft_vocab(token_counts)
    freeze_mask_embedding(model, target, init=True)
    if cfg["drafter"].get("init_from_target"):
        if config.num_hidden_layers > target.num_layers:
            raise DeepSpecError(
                f"init_from_target: {config.num_hidden_layers} draft layers but the target has {target.num_layers}"
            )
        model.init_layers_from_target(target, model.layers, model.norm)
    return model


def load_drafter(path, target, drafter_cfg: dict | None = None):
    from safetensors import SafetensorError
    from transformers import AutoConfig

    method = read_method(path)
    try:
        config = AutoConfig.from_pretrained(str(path))
        check_target_match(config, target, where=f"drafter at {path}")
        if drafter_cfg is not None:
            check_layer_arch(config, target, drafter_cfg, where=f"drafter at {path}")
        model = CLASSES[method].from_pretrained(str(path), config=config).to(target.device)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:  # missing / truncated weights, bad config
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DeepSpecError(f"cannot load the drafter at {path}: {first}") from None
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

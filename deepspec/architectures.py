"""The target architectures the drafters are built from (drafters/blocks.py),
and the draft layers' own architecture (`drafter.layer_arch`), as data without
torch, so that the plan-time checks (planning/preflight.py) refuse an unknown
text model type or an impossible layer choice before any job runs."""
from __future__ import annotations

from typing import Mapping

from .errors import DeepSpecError

# model_type -> (transformers modeling module, class-name prefix of the layer
# classes, class name of the RMSNorm). Gemma4's text classes carry "Text" in
# their names but its RMSNorm does not.
ARCHITECTURES = {
    "llama": ("llama", "Llama", "LlamaRMSNorm"),
    "mistral": ("mistral", "Mistral", "MistralRMSNorm"),
    "qwen2": ("qwen2", "Qwen2", "Qwen2RMSNorm"),
    "qwen3": ("qwen3", "Qwen3", "Qwen3RMSNorm"),
    "gemma4_text": ("gemma4", "Gemma4Text", "Gemma4RMSNorm"),
    # google/gemma-4-12B-it's text decoder (transformers 5.24 models/gemma4_unified): its
    # attention, MLP, RMSNorm, rotary embedding and rotary helper are gemma4's code under
    # new names (the same source); its decoder layer drops gemma4's MoE / per-layer inputs.
    "gemma4_unified_text": ("gemma4_unified", "Gemma4UnifiedText", "Gemma4UnifiedRMSNorm"),
}
# model types whose draft layers are the same code (a checkpoint made for one fits the other)
SAME_LAYERS = {"gemma4_unified_text": "gemma4_text", "gemma4_unified": "gemma4_text", "gemma4": "gemma4_text"}


def same_layers(a, b) -> bool:
    """Whether model types a and b (text decoders or their multimodal wrappers) build the same draft layers."""
    return SAME_LAYERS.get(a, a) == SAME_LAYERS.get(b, b)


def check_model_type(model_type, where: str = "") -> None:
    """One-line DeepSpecError unless the drafters have blocks for `model_type`."""
    if model_type not in ARCHITECTURES:
        raise DeepSpecError(f"{where + ': ' if where else ''}unsupported target architecture {model_type!r}: "
                            f"drafters support {', '.join(sorted(ARCHITECTURES))}")


# drafter.layer_arch: the architecture of the draft layers. "target" builds them from
# the target's own layer classes (paper Sec. 3, the reference); "qwen3" builds Qwen3
# layers (q/k RMSNorm per head) sized from the target, the one layer vLLM serves
# DFlash/DSpark drafters through (Qwen3DSparkModel, over any target with the EAGLE-3
# hidden-state interface, Llama included). A string applies to every method, a
# mapping {method: arch} to the methods it names (the others: "target").
LAYER_ARCHS = ("target", "qwen3")
# targets whose drafts must keep the target's layer semantics: Gemma4 drafts are
# Gemma4 layers (scaled embeddings, sandwich norms, keys as values), which vLLM
# serves as Gemma4DSparkModel; a Qwen3 layer has no geometry to take from them
OWN_LAYERS_ONLY = ("gemma4_text", "gemma4_unified_text", "gemma4_unified", "gemma4")


def layer_arch_of(drafter, method: str) -> str:
    """drafter.layer_arch for `method` (a base method: eagle3, dflash, dspark) of the
    drafter settings (`settings.Drafter`, or the config's drafter section)."""
    arch = drafter.get("layer_arch", "target") if isinstance(drafter, Mapping) else drafter.layer_arch
    if isinstance(arch, dict):
        arch = arch.get(method, "target")
    if arch not in LAYER_ARCHS:
        raise DeepSpecError(f"drafter.layer_arch {arch!r} for {method}: use one of {', '.join(LAYER_ARCHS)}")
    return arch


def draft_model_type(target_model_type, arch: str, where: str = "") -> str:
    """The model type of the draft layers that `arch` builds for a target of
    `target_model_type`; one-line DeepSpecError when that target cannot have them."""
    check_model_type(target_model_type, where)
    if arch == "target" or same_layers(arch, target_model_type):
        return target_model_type
    if arch not in LAYER_ARCHS:
        raise DeepSpecError(f"{where + ': ' if where else ''}drafter.layer_arch {arch!r}: use one of "
                            f"{', '.join(LAYER_ARCHS)}")
    if target_model_type in OWN_LAYERS_ONLY:
        raise DeepSpecError(f"{where + ': ' if where else ''}drafter.layer_arch {arch!r} over a "
                            f"{target_model_type} target: Gemma4 drafts are Gemma4 layers (vLLM serves them as "
                            "Gemma4DSparkModel); use layer_arch target")
    return arch

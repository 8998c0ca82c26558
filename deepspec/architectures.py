"""The target architectures the drafters are built from (drafters/blocks.py),
as data without torch, so that the plan-time checks (planning/preflight.py)
refuse an unknown text model type before any job runs."""
from __future__ import annotations

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

"""What every export layout shares (docs/FORMATS.md): the engines' class prefixes,
vLLM's speculative config for the paper's protocol, the null Markov head that
carries a DFlash drafter into vLLM's DSpark, and the one-line refusal."""
from __future__ import annotations

from ..errors import DeepSpecError

PREFIX = {"qwen3": "Qwen3", "gemma4_text": "Gemma4", "gemma4_unified_text": "Gemma4"}  # DeepSpec's classes exist for these



# vLLM's speculative config for the paper's protocol (docs/FORMATS.md): the method named
# (auto-detection picks "dflash" from a path containing it and crashes), probabilistic
# drafting (its default is greedy).
VLLM_DSPARK_SPEC = {"method": "dspark", "draft_sample_method": "probabilistic"}



# A DFlash drafter for vLLM 0.32 (docs/FORMATS.md §1.2). vLLM's own DFlash class
# (DFlashDraftModel, speculative method "dflash") runs z-lab's 1 + N block, the anchor
# being the bonus token, and refuses sample_from_anchor (v1/worker/gpu/spec_decode/dflash/
# speculator.py); DeepSpec's DFlash predicts the first draft token at the anchor, which in
# vLLM only method "dspark" does. Its Qwen3DSparkModel / Gemma4DSparkModel build the Markov
# head from config.markov_rank unconditionally (qwen3_dspark.py Qwen3DSparkModel.__init__,
# gemma4_dspark.py), so markov_rank 0 gives [V, 0] / [K, 0] layers, on which the CPU
# loader's oneDNN GEMM set-up crashes (SIGFPE, model_executor/layers/utils.py
# dispatch_cpu_unquantized_gemm) and tensor parallelism crashed (vllm#49646). The export
# therefore writes a null Markov head: rank NULL_MARKOV_RANK, both factors zero, so the
# bias W1[x] W2^T is exactly 0 and the drafter computes DFlash's proposals bit for bit.
NULL_MARKOV_RANK = 1



EAGLE3_ARCH = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "LlamaForCausalLMEagle3"}



def base_config(d) -> dict:
    """The draft layers' config without deepspec's own fields."""
    c = {k: v for k, v in d.config.to_dict().items() if not k.startswith("deepspec_")}
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        c.pop(k, None)
    return dict(c, tie_word_embeddings=False)



def refuse(what: str, why: str):
    raise DeepSpecError(f"cannot export {what}: {why}")



def qwen3_block_only(d, eagle3_as: str, eagle3_why: str, family_as: str, family_why: str) -> None:
    """Refuse an Eagle3 drafter, or draft layers other than Qwen3's, for a layout of Qwen3 block drafters."""
    if d.method == "eagle3":
        refuse(f"an Eagle3 drafter {eagle3_as}", eagle3_why)
    if d.config.model_type != "qwen3":
        refuse(f"a {d.config.model_type} drafter {family_as}", family_why)

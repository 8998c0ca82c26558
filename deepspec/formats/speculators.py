"""The speculators format (vllm-project/speculators; vLLM
transformers_utils/configs/speculators/): the config `vllm serve DIR` configures
itself from, over the tensors of the vLLM deepspec export (docs/FORMATS.md §3)."""
from __future__ import annotations

from ..fetch import not_a_hub_id
from .common import VLLM_DSPARK_SPEC, base_config, qwen3_block_only
from .convert import MASK_APPENDED_FIELD, NULL_MARKOV_FIELD
from .deepspec_layout import deepspec_layout


def speculators_layout(d, target, mask_token_id=None, verifier=None):
    """(config dict, tensors) of a DSpark / DFlash drafter in the speculators format
    vLLM 0.32 configures `vllm serve DIR` from (docs/FORMATS.md §3): the tensors of
    the vLLM deepspec export, the draft layers' config as `transformer_layer_config`,
    the algorithm fields at the top level."""
    c = d.config
    qwen3_block_only(d, "as speculators", "this export writes DFlash/DSpark drafters (speculators_model_type dspark); "
                      "vLLM reads Eagle3 from --format eagle3", "as speculators",
                      "vLLM maps speculators-format DSpark to Qwen3DSparkModel (Qwen3 draft layers) only")
    ref, sd = deepspec_layout(d, target, mask_token_id, engine="vllm")
    layer = {k: v for k, v in base_config(d).items() if k != "architectures"}
    layer.update(num_hidden_layers=int(c.num_hidden_layers), vocab_size=int(ref["vocab_size"]))
    gamma = int(ref["block_size"])
    name = verifier or c.deepspec_target_id
    cfg = {"architectures": ["Qwen3DSparkModel"], "speculators_model_type": "dspark",
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": str(name),
                                               "architectures": list(getattr(target.config, "architectures", None)
                                                                    or [type(target.model).__name__])}},
           "transformer_layer_config": layer,
           "draft_vocab_size": int(ref.get("draft_vocab_size", ref["vocab_size"])),
           "target_hidden_size": int(c.deepspec_target_hidden_size), "block_size": gamma,
           "mask_token_id": int(ref["mask_token_id"]), "markov_rank": int(ref["markov_rank"]),
           "markov_head_type": ref["markov_head_type"], "enable_confidence_head": bool(ref["enable_confidence_head"]),
           # vLLM: target_layer_ids = aux ids - 1 (our feature layers), eagle_aux ids = these
           "aux_hidden_state_layer_ids": [x + 1 for x in c.deepspec_feature_layers], "use_aux_hidden_state": True,
           "sample_from_anchor": True,  # DeepSpec's block: the anchor predicts draft token 1 (vLLM's default: false)
           "deepspec_feature_layers": list(c.deepspec_feature_layers),
           "deepspec_serve_vllm": {"speculative_config": {"draft_sample_method": "probabilistic"}}}
    if not_a_hub_id(str(name)):
        # vLLM >= 0.34 refuses `vllm serve DIR` for a verifier on disk (maybe_override_with_speculators:
        # "must name a remote model repository"); both 0.32 and 0.34 serve the target explicitly
        cfg["deepspec_serve_vllm"] = {"model": str(name), "speculative_config": dict(
            VLLM_DSPARK_SPEC, num_speculative_tokens=gamma)}
    for key in ("confidence_head_with_markov", NULL_MARKOV_FIELD, "deepspec_note_markov", MASK_APPENDED_FIELD,
                "deepspec_note"):
        if key in ref:
            cfg[key] = ref[key]
    return cfg, sd

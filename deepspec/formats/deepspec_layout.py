"""DeepSeek's DeepSpec layout (`<X>DSparkModel`, `<X>Eagle3Model`; X = Qwen3 or
Gemma4), the exact inverse of `convert-checkpoint`, and what vLLM's and SGLang's
DSpark loaders read from it (docs/FORMATS.md §1)."""
from __future__ import annotations

import logging

import torch

from .common import NULL_MARKOV_RANK, PREFIX, VLLM_DSPARK_SPEC, base_config, refuse
from .convert import (
    MASK_APPENDED_FIELD,
    MASK_ROW_FIELD,
    NOT_IN_CHECKPOINT,
    NULL_MARKOV_FIELD,
    NULL_MARKOV_TENSORS,
    embed_scale,
    to_reference,
)
from .sglang import check_for_sglang

log = logging.getLogger(__name__)

# MASK_APPENDED_FIELD: a block drafter with a learned mask embedding (a target without a
# reserved token, such as SmolLM2) for vLLM: the mask becomes token V, one past the target's vocabulary, in
# the drafter's own input embedding of V + 1 rows (the target's rows, then the learned
# one; markov_w1 gets a zero row V). vLLM's Qwen3 DSpark loads such an "expanded input
# vocabulary" with its own embed_tokens and never shares the target's
# (qwen3_dspark.py load_weights, v1/worker/gpu/spec_decode/dspark/utils.py
# load_dspark_model), so no token's embedding is overwritten.


def _mask_token(d, target, mask_token_id, engine=None):
    """(mask id, how its embedding is written: None = the target's row, "row" = a
    target row overwritten, "appended" = a new row V) of a block drafter."""
    mid = d.config.deepspec_mask_token_id
    if mid is not None:
        with torch.no_grad():
            ref = target.embed_tokens(torch.tensor([mid], device=target.embed_tokens.weight.device))[0]
        if not torch.equal(ref.float().cpu(), d.mask_embedding.detach().float().cpu()):
            refuse("the mask embedding", f"it is not the target's embedding of mask_token_id {mid}")
        return mid, None
    if engine == "vllm":  # see MASK_APPENDED_FIELD
        if mask_token_id is not None:
            refuse("for vLLM with --mask-token-id", "a learned mask embedding goes into a new row V of the "
                    "drafter's own input vocabulary, overwriting no token")
        return int(target.vocab_size), "appended"
    mid = int(target.vocab_size) - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mid < target.vocab_size:
        refuse("the mask embedding", f"mask token {mid} is outside the target vocabulary")
    return mid, "row"



def _check_for_vllm(d) -> None:
    """What vLLM's Qwen3/Gemma4 DSpark loaders would load wrongly, refused in one line."""
    c, gemma4 = d.config, d.config.model_type != "qwen3"
    if d.method == "eagle3":
        refuse("an Eagle3 drafter as deepspec for vLLM", "vLLM serves Eagle3 from the eagle3 layout (--format eagle3)")
    if c.deepspec_markov_rank > 0 and c.deepspec_markov_head_type != "vanilla":
        refuse("for vLLM", f"vLLM's DSpark implements the vanilla Markov head only, this drafter's is "
                f"{c.deepspec_markov_head_type!r} (its weights would be rejected or, for Gemma4, ignored)")
    if c.deepspec_mask_token_id is None and gemma4:
        refuse("a Gemma4 drafter for vLLM", "this drafter has a learned mask embedding, and vLLM's Gemma4 DSpark "
                "has no input vocabulary of its own to carry it: train with drafter.mask_token_id")
    if gemma4 and d.reduced_vocab:
        refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark has a full-vocabulary head only")
    if gemma4 and not getattr(c, "attention_k_eq_v", False):
        refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark requires attention_k_eq_v in every draft layer")



# vLLM's Gemma4DSparkForCausalLM (gemma4_dspark.py @054f072, its decoder layer from gemma4_mtp.py)
# loads a checkpoint name only when its model has that parameter or buffer and skips the
# rest silently: the names it has, per draft layer (k_eq_v: no v_proj; v_norm has no weight)
# and at the top (vLLM 0.32's gemma4_dspark.py reads the same names; a DFlash export has the
# null Markov head, see NULL_MARKOV_RANK; the confidence head is built when enabled).
VLLM_GEMMA4_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                     "post_feedforward_layernorm.weight", "layer_scalar")



VLLM_GEMMA4_TOP = ("embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight")



VLLM_GEMMA4_MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")



VLLM_GEMMA4_CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")



def check_vllm_gemma4_names(cfg: dict, sd: dict) -> None:
    """Refuse a Gemma4 DSpark/DFlash export whose tensor names differ from what vLLM's
    Gemma4 DSpark loader has: an extra name would be dropped, a missing one left at
    its initial value, both silently. vLLM 0.32 builds the confidence head when the
    config enables it (gemma4_dspark.py) and keeps it when the checkpoint has it."""
    want = set(VLLM_GEMMA4_TOP) | {f"layers.{i}.{n}" for i in range(int(cfg["num_hidden_layers"]))
                                    for n in VLLM_GEMMA4_LAYER}
    if int(cfg.get("markov_rank") or 0) > 0:
        want |= set(VLLM_GEMMA4_MARKOV)
    if cfg.get("enable_confidence_head"):
        want |= set(VLLM_GEMMA4_CONFIDENCE)
    have = set(sd)
    for what, names in (("has", sorted(have - want)), ("lacks", sorted(want - have))):
        if names:
            refuse("a Gemma4 drafter for vLLM", f"the export {what} {', '.join(names[:3])}"
                    f"{' ...' if len(names) > 3 else ''}, which vLLM's Gemma4 DSpark loader "
                    f"{'skips' if what == 'has' else 'would leave at initialisation'} silently")



def deepspec_layout(d, target, mask_token_id=None, engine=None):
    """(config dict, tensors) of drafter d in DeepSeek's layout; engine "vllm" /
    "sglang": the fields that engine's DSpark loader reads, refusing what it would
    load wrongly (vLLM: DFlash gets a null Markov head, NULL_MARKOV_RANK)."""
    c = d.config
    family = c.model_type
    if family not in PREFIX:
        refuse(f"a {family} drafter as deepspec", "DeepSpec has Qwen3 and Gemma4 drafter classes only")
    if engine == "sglang":
        check_for_sglang(d)
    elif engine == "vllm":
        _check_for_vllm(d)
    elif d.reduced_vocab:
        refuse("as deepspec", "the layout has a full-vocabulary head; this drafter has a reduced draft vocabulary "
                "(vLLM reads one from Qwen3 DSpark exports: --engine vllm)")
    cfg = dict(base_config(d), num_target_layers=int(c.deepspec_target_num_layers),
               target_layer_ids=list(c.deepspec_feature_layers))
    sd = {to_reference(k): v.detach().clone().contiguous() for k, v in d.state_dict().items()
          if k not in NOT_IN_CHECKPOINT}
    emb = target.embed_tokens.weight.detach().clone().cpu()
    if d.method == "eagle3":
        cfg.update(architectures=[f"{PREFIX[family]}Eagle3Model"], ttt_length=int(c.deepspec_ttt_length),
                   step_loss_decay=0.8, draft_num_hidden_layers=int(c.num_hidden_layers))
    else:
        mid, written = _mask_token(d, target, mask_token_id, engine)
        cfg.update(architectures=[f"{PREFIX[family]}DSparkModel"], block_size=int(c.deepspec_block_size),
                   mask_token_id=mid, num_anchors=512, markov_rank=int(c.deepspec_markov_rank),
                   enable_confidence_head=bool(c.deepspec_confidence_head))
        if c.deepspec_markov_rank > 0:
            cfg["markov_head_type"] = c.deepspec_markov_head_type
        conf = getattr(d, "confidence", None)
        if conf is not None:  # the head as built: no Markov input without a Markov head
            cfg["confidence_head_with_markov"] = bool(conf.with_markov)
        if written == "appended":
            emb = torch.cat([emb, (d.mask_embedding.detach().float().cpu() / embed_scale(target)).to(emb.dtype)[None]])
            # the input vocabulary gains the mask's row, the drafted one does not: engines size
            # lm_head / markov_w2 by draft_vocab_size, falling back to vocab_size (V + 1)
            cfg.update(vocab_size=mid + 1, draft_vocab_size=mid, **{MASK_APPENDED_FIELD: True})
            cfg["deepspec_note"] = (f"embed_tokens row {mid} (one past the target's vocabulary) holds the drafter's "
                                    f"learned mask embedding; markov_w1 row {mid} is zero (no token is ever {mid})")
        elif written == "row":
            log.warning("the learned mask embedding goes into embed_tokens row %d: vLLM's V1 DSpark proposer and "
                        "SGLang replace that row by the target's embedding (only vLLM's model runner V2 keeps it)", mid)
            emb[mid] = (d.mask_embedding.detach().float().cpu() / embed_scale(target)).to(emb.dtype)
            cfg[MASK_ROW_FIELD] = True
            cfg["deepspec_note"] = (f"embed_tokens row {mid} holds the drafter's learned mask embedding, "
                                    "not the target's embedding of that token")
    sd["embed_tokens.weight"] = emb
    sd["lm_head.weight"] = target.lm_head.weight.detach().clone().cpu()
    if d.reduced_vocab:  # vLLM only (checked above): K-row head and markov_w2, d2t offsets
        d2t = d.d2t.detach().cpu()
        sd["lm_head.weight"] = sd["lm_head.weight"][d2t]
        sd["d2t"] = d2t - torch.arange(d2t.numel())
        cfg["draft_vocab_size"] = int(d2t.numel())
    if engine == "vllm" and d.method != "eagle3":
        if c.deepspec_markov_rank == 0:
            _null_markov_head(cfg, sd, d)
        elif cfg.get(MASK_APPENDED_FIELD):  # markov_w1 spans the input vocabulary, the mask's row included
            w1 = NULL_MARKOV_TENSORS[0]
            sd[w1] = torch.cat([sd[w1], sd[w1].new_zeros(1, sd[w1].shape[1])])
        cfg["deepspec_serve_vllm"] = {"speculative_config": dict(VLLM_DSPARK_SPEC, num_speculative_tokens=int(c.deepspec_block_size))}
    if engine == "sglang":
        cfg["sample_from_anchor"] = True  # DeepSpec's block (SGLang's default; speculators checkpoints say false)
    return cfg, sd



def _null_markov_head(cfg: dict, sd: dict, d) -> None:
    """A DFlash drafter as vLLM's DSpark: a rank-NULL_MARKOV_RANK Markov head whose
    factors are zero, so its bias is exactly 0 (see NULL_MARKOV_RANK)."""
    w1, w2 = NULL_MARKOV_TENSORS
    dtype = sd["fc.weight"].dtype
    sd[w1] = torch.zeros(int(cfg["vocab_size"]), NULL_MARKOV_RANK, dtype=dtype)
    sd[w2] = torch.zeros(d.draft_vocab_size, NULL_MARKOV_RANK, dtype=dtype)
    cfg.update(markov_rank=NULL_MARKOV_RANK, markov_head_type="vanilla", confidence_head_with_markov=False)
    cfg[NULL_MARKOV_FIELD] = True
    cfg["deepspec_note_markov"] = ("a DFlash drafter: markov_head is a null head (rank 1, all zeros, bias exactly 0), "
                                   "because vLLM serves DeepSpec's anchor-first block only as dspark")

"""The export-checkpoint command: write a deepspec drafter in a layout that other
tools load (docs/FORMATS.md gives each layout with its sources).

* ``deepspec``: DeepSeek's DeepSpec layout (`<X>DSparkModel` for DFlash, with
  markov_rank 0, and DSpark; `<X>Eagle3Model`; X = Qwen3 or Gemma4), the exact
  inverse of `convert-checkpoint`: the drafter's tensors under the reference's
  names, frozen copies of the target's `embed_tokens` / `lm_head`, the
  reference's config fields. vLLM's `method: "dspark"` reads it for Qwen3
  DFlash/DSpark drafters.
* ``eagle3``: the EAGLE-3 / SpecForge layout that vLLM and SGLang serve: one
  decoder layer under `midlayer.*`, `fc`, `norm`, `lm_head` = the target head's
  rows of the draft vocabulary, `d2t` (target id - draft id) and `t2d` (bool),
  no `embed_tokens`; `architectures` Eagle3Qwen3ForCausalLM (Qwen3 layer) or
  LlamaForCausalLMEagle3 (Llama layer), and the feature layers in vLLM's
  convention (input of layer j: ours + 1).

A drafter that a layout cannot represent is refused with one line before
anything is written (wrong layer family, depth, number of feature layers,
reduced vocabulary where the layout has none); `out` appears only complete.
Block drafters without a reserved mask token (a learned mask embedding) are
exported with `embed_tokens` row `mask_token_id` overwritten by that embedding,
and the config says so (`convert.MASK_ROW_FIELD`).
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from ..errors import DeepSpecError
from ..files import atomic_dir
from .convert import MASK_ROW_FIELD, NOT_IN_CHECKPOINT, check_out_apart, embed_scale, to_reference

log = logging.getLogger(__name__)

FORMATS = ("deepspec", "eagle3")
PREFIX = {"qwen3": "Qwen3", "gemma4_text": "Gemma4", "gemma4_unified_text": "Gemma4"}  # DeepSpec's classes exist for these
ENGINES = ("vllm", "sglang")
# vLLM's speculative config for the paper's protocol (docs/FORMATS.md): the method named
# (auto-detection picks "dflash" from a path containing it and crashes), probabilistic
# drafting (its default is greedy); DFlash (markov_rank 0) on one GPU only (its zero-width
# Markov head crashes at tensor parallel > 1).
VLLM_DSPARK_SPEC = {"method": "dspark", "draft_sample_method": "probabilistic"}
EAGLE3_ARCH = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "LlamaForCausalLMEagle3"}


def _base_config(d) -> dict:
    """The draft layers' config without deepspec's own fields."""
    c = {k: v for k, v in d.config.to_dict().items() if not k.startswith("deepspec_")}
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        c.pop(k, None)
    return dict(c, tie_word_embeddings=False)


def _refuse(what: str, why: str):
    raise DeepSpecError(f"cannot export {what}: {why}")


# ----------------------------------------------------------------------------------------------
# the deepspec (reference) layout


def _mask_token(d, target, mask_token_id):
    """(mask id, row overwritten?) of a block drafter."""
    mid = d.config.deepspec_mask_token_id
    if mid is not None:
        with torch.no_grad():
            ref = target.embed_tokens(torch.tensor([mid], device=target.embed_tokens.weight.device))[0]
        if not torch.equal(ref.float().cpu(), d.mask_embedding.detach().float().cpu()):
            _refuse("the mask embedding", f"it is not the target's embedding of mask_token_id {mid}")
        return mid, False
    mid = int(target.vocab_size) - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mid < target.vocab_size:
        _refuse("the mask embedding", f"mask token {mid} is outside the target vocabulary")
    return mid, True


def _check_for_vllm(d) -> None:
    """What vLLM's Qwen3/Gemma4 DSpark loaders would load wrongly, refused in one line."""
    c, gemma4 = d.config, d.config.model_type != "qwen3"
    if d.method == "eagle3":
        _refuse("an Eagle3 drafter as deepspec for vLLM", "vLLM serves Eagle3 from the eagle3 layout (--format eagle3)")
    if c.deepspec_markov_rank > 0 and c.deepspec_markov_head_type != "vanilla":
        _refuse("for vLLM", f"vLLM's DSpark implements the vanilla Markov head only, this drafter's is "
                f"{c.deepspec_markov_head_type!r} (its weights would be rejected or, for Gemma4, ignored)")
    if c.deepspec_mask_token_id is None:
        _refuse("for vLLM", "this drafter has a learned mask embedding, which vLLM's V1 proposer replaces by the "
                "target's embedding of mask_token_id: train with drafter.mask_token_id")
    if gemma4 and d.reduced_vocab:
        _refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark has a full-vocabulary head only")
    if gemma4 and not getattr(c, "attention_k_eq_v", False):
        _refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark requires attention_k_eq_v in every draft layer")


# vLLM's Gemma4DSparkForCausalLM (gemma4_dspark.py @054f072, its decoder layer from gemma4_mtp.py)
# loads a checkpoint name only when its model has that parameter or buffer and skips the
# rest silently: the names it has, per draft layer (k_eq_v: no v_proj; v_norm has no weight)
# and at the top; its Markov head's two tensors have zero width at markov_rank 0.
VLLM_GEMMA4_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                     "post_feedforward_layernorm.weight", "layer_scalar")
VLLM_GEMMA4_TOP = ("embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight")
VLLM_GEMMA4_MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


def check_vllm_gemma4_names(cfg: dict, sd: dict) -> None:
    """Refuse a Gemma4 DSpark/DFlash export whose tensor names differ from what vLLM's
    Gemma4 DSpark loader has: an extra name would be dropped, a missing one left at
    its initial value, both silently. The confidence head is the one name it skips by
    design (no adaptive verification there): a warning."""
    want = set(VLLM_GEMMA4_TOP) | {f"layers.{i}.{n}" for i in range(int(cfg["num_hidden_layers"]))
                                    for n in VLLM_GEMMA4_LAYER}
    if int(cfg.get("markov_rank") or 0) > 0:
        want |= set(VLLM_GEMMA4_MARKOV)
    have = {k for k in sd if "confidence_head" not in k}
    for what, names in (("has", sorted(have - want)), ("lacks", sorted(want - have))):
        if names:
            _refuse("a Gemma4 drafter for vLLM", f"the export {what} {', '.join(names[:3])}"
                    f"{' ...' if len(names) > 3 else ''}, which vLLM's Gemma4 DSpark loader "
                    f"{'skips' if what == 'has' else 'would leave at initialisation'} silently")
    if len(have) < len(sd):
        log.warning("vLLM's Gemma4 DSpark skips the confidence head: it serves fixed-length blocks "
                    "(no adaptive verification)")


def deepspec_layout(d, target, mask_token_id=None, engine=None):
    """(config dict, tensors) of drafter d in DeepSeek's layout; engine "vllm": the
    fields vLLM's DSpark loaders read, refusing what they would load wrongly."""
    c = d.config
    family = c.model_type
    if family not in PREFIX:
        _refuse(f"a {family} drafter as deepspec", "DeepSpec has Qwen3 and Gemma4 drafter classes only")
    if engine == "sglang":
        _refuse("as deepspec for SGLang", "SGLang has no upstream loader for Qwen3DSparkModel/Gemma4DSparkModel")
    if engine == "vllm":
        _check_for_vllm(d)
    elif d.reduced_vocab:
        _refuse("as deepspec", "the layout has a full-vocabulary head; this drafter has a reduced draft vocabulary "
                "(vLLM reads one from Qwen3 DSpark exports: --engine vllm)")
    cfg = dict(_base_config(d), num_target_layers=int(c.deepspec_target_num_layers),
               target_layer_ids=list(c.deepspec_feature_layers))
    sd = {to_reference(k): v.detach().clone().contiguous() for k, v in d.state_dict().items()
          if k not in NOT_IN_CHECKPOINT}
    emb = target.embed_tokens.weight.detach().clone().cpu()
    if d.method == "eagle3":
        cfg.update(architectures=[f"{PREFIX[family]}Eagle3Model"], ttt_length=int(c.deepspec_ttt_length),
                   step_loss_decay=0.8, draft_num_hidden_layers=int(c.num_hidden_layers))
    else:
        mid, overwritten = _mask_token(d, target, mask_token_id)
        cfg.update(architectures=[f"{PREFIX[family]}DSparkModel"], block_size=int(c.deepspec_block_size),
                   mask_token_id=mid, num_anchors=512, markov_rank=int(c.deepspec_markov_rank),
                   enable_confidence_head=bool(c.deepspec_confidence_head))
        if c.deepspec_markov_rank > 0:
            cfg["markov_head_type"] = c.deepspec_markov_head_type
        if c.deepspec_confidence_head:
            cfg["confidence_head_with_markov"] = bool(c.deepspec_confidence_with_markov)
        if overwritten:
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
        cfg["deepspec_serve_vllm"] = {"speculative_config": dict(VLLM_DSPARK_SPEC, num_speculative_tokens=int(c.deepspec_block_size))}
        if c.deepspec_markov_rank == 0:
            cfg["deepspec_serve_vllm"]["tensor_parallel_size"] = 1
    return cfg, sd


# ----------------------------------------------------------------------------------------------
# the EAGLE-3 (SpecForge / vLLM / SGLang) layout


def eagle3_layout(d, target):
    """(config dict, tensors) of an Eagle3 drafter in the EAGLE-3 layout."""
    c = d.config
    if d.method != "eagle3":
        _refuse(f"a {d.method} drafter as eagle3", "only Eagle3 drafters have that layout")
    if c.model_type not in EAGLE3_ARCH:
        _refuse(f"a {c.model_type} Eagle3 layer as eagle3", f"the engines' EAGLE-3 classes have the "
                f"{' and '.join(sorted(EAGLE3_ARCH))} layers only")
    if c.num_hidden_layers != 1:
        _refuse("as eagle3", f"the layout has one decoder layer (midlayer), this drafter has {c.num_hidden_layers}")
    layers = list(c.deepspec_feature_layers)  # vLLM sizes fc from this list's length (any count)
    K, V = d.draft_vocab_size, d.vocab_size
    d2t = d.d2t.detach().cpu() if d.reduced_vocab else torch.arange(V)
    cfg = dict(_base_config(d), architectures=[EAGLE3_ARCH[c.model_type]], vocab_size=V, draft_vocab_size=K,
               target_hidden_size=int(c.deepspec_target_hidden_size), num_hidden_layers=1,
               eagle_aux_hidden_state_layer_ids=[x + 1 for x in layers],
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers,  # SGLang adds the 1 itself
                             "use_aux_hidden_state": True},
               deepspec_feature_layers=layers)
    sd = {}
    for k, v in d.state_dict().items():
        if k in NOT_IN_CHECKPOINT:
            continue
        sd[k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k] = v.detach().clone()
    sd["lm_head.weight"] = target.lm_head.weight.detach()[d2t.to(target.lm_head.weight.device)].float().cpu()
    if d.reduced_vocab:  # the engines create the vocabulary map only for K < V (and refuse it otherwise)
        sd["d2t"] = d2t - torch.arange(K)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[d2t] = True
        sd["t2d"] = t2d
    return cfg, sd


def expected_tensors(fmt: str, cfg: dict) -> dict[str, tuple]:
    """The names and shapes an `eagle3` export must hold (docs/FORMATS.md),
    from its config: what SpecForge's exporter checks before writing."""
    if fmt != "eagle3":
        raise ValueError(fmt)
    d, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // H
    m = len(cfg["eagle_aux_hidden_state_layer_ids"])
    out = {"fc.weight": (d, m * cfg["target_hidden_size"]), "norm.weight": (d,),
           "lm_head.weight": (cfg["draft_vocab_size"], d), "midlayer.hidden_norm.weight": (d,),
           "midlayer.input_layernorm.weight": (d,), "midlayer.post_attention_layernorm.weight": (d,),
           "midlayer.self_attn.q_proj.weight": (H * hd, 2 * d), "midlayer.self_attn.k_proj.weight": (Hkv * hd, 2 * d),
           "midlayer.self_attn.v_proj.weight": (Hkv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": (d, H * hd),
           "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], d),
           "midlayer.mlp.up_proj.weight": (cfg["intermediate_size"], d),
           "midlayer.mlp.down_proj.weight": (d, cfg["intermediate_size"])}
    if cfg["draft_vocab_size"] < cfg["vocab_size"]:  # the vocabulary map of a reduced draft vocabulary
        out.update({"d2t": (cfg["draft_vocab_size"],), "t2d": (cfg["vocab_size"],)})
    if cfg["architectures"][0] == "Eagle3Qwen3ForCausalLM":
        out.update({"midlayer.self_attn.q_norm.weight": (hd,), "midlayer.self_attn.k_norm.weight": (hd,)})
    return out


def _check_eagle3(cfg: dict, sd: dict) -> None:
    want = expected_tensors("eagle3", cfg)
    have = {k: tuple(v.shape) for k, v in sd.items()}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            _refuse("as eagle3", f"tensor {name}: expected {want.get(name)}, have {have.get(name)} "
                    "(the engines drop or miss such names silently)")


# ----------------------------------------------------------------------------------------------
# writing


def export_drafter(d, target, fmt: str, out, *, overwrite: bool = False, mask_token_id=None, engine=None) -> Path:
    """Write drafter d (attached to target) in layout `fmt` at `out`, atomically;
    `engine` (vllm, sglang): refuse what that engine would load wrongly."""
    from safetensors.torch import save_file

    out = Path(out)
    if fmt not in FORMATS:
        raise DeepSpecError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if engine not in (None, *ENGINES):
        raise DeepSpecError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if out.exists() and not overwrite:
        raise DeepSpecError(f"output {out} exists (use --overwrite)")
    if fmt == "deepspec":
        cfg, sd = deepspec_layout(d, target, mask_token_id, engine)
        if engine == "vllm" and cfg["architectures"] == ["Gemma4DSparkModel"]:
            check_vllm_gemma4_names(cfg, sd)
    else:
        cfg, sd = eagle3_layout(d, target)
        if engine == "sglang" and cfg["architectures"] != [EAGLE3_ARCH["llama"]]:
            _refuse("as eagle3 for SGLang", "SGLang's EAGLE-3 draft class is LlamaForCausalLMEagle3 (Llama layer) only")
        _check_eagle3(cfg, sd)
    cfg["deepspec_exported_from"] = {"target": d.config.deepspec_target_id, "method": d.method, "format": fmt}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    log.info("exported %s drafter as %s (%d tensors) -> %s", d.method, fmt, len(sd), out)
    if "deepspec_serve_vllm" in cfg:
        serve = cfg["deepspec_serve_vllm"]
        log.info("serve with%s --speculative-config '%s'", " --tensor-parallel-size 1" if "tensor_parallel_size" in serve
                 else "", json.dumps(dict(serve["speculative_config"], model=str(out))))
    return out


def cli_export_checkpoint(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec export-checkpoint",
                                description="write a deepspec drafter in DeepSeek's (deepspec) or the EAGLE-3 layout")
    add_config_args(p)
    p.add_argument("--src", required=True, help="deepspec drafter directory (train or convert-checkpoint output)")
    p.add_argument("--format", required=True, choices=FORMATS, help="deepspec (DeepSpec, vLLM dspark) or eagle3 "
                   "(SpecForge, vLLM and SGLang eagle3)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="block drafters with a learned mask embedding: the embed_tokens row to overwrite (default V-1)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="the engine that will serve the export: refuse what it would load wrongly (vllm: vanilla "
                        "Markov head, reserved mask token; allows Qwen3 reduced vocabularies)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    check_out_apart(args.src, args.out)
    cfg = config_from_args(args)
    from ..drafters import load_drafter
    from ..targets.loading import target_from_config

    target = target_from_config(cfg)
    d = load_drafter(args.src, target)
    export_drafter(d, target, args.format, args.out, overwrite=args.overwrite, mask_token_id=args.mask_token_id,
                   engine=args.engine)
    return 0


def export_for_engine(d, target, engine: str, out, *, overwrite: bool = False) -> dict:
    """Export drafter d as `engine` serves it (vLLM: Eagle3 in the EAGLE-3 layout,
    DFlash/DSpark in DeepSeek's) and return the engine's speculative config for it
    (without the model path): method, num_speculative_tokens and the serve settings
    the export names."""
    if engine != "vllm":
        raise DeepSpecError(f"serving checks run in vLLM only, not {engine!r}")
    c = d.config
    if d.method == "eagle3":
        export_drafter(d, target, "eagle3", out, overwrite=overwrite, engine=engine)
        return {"method": "eagle3", "num_speculative_tokens": int(c.deepspec_ttt_length)}
    path = export_drafter(d, target, "deepspec", out, overwrite=overwrite, engine=engine)
    cfg = json.loads((Path(path) / "config.json").read_text())
    return dict(cfg["deepspec_serve_vllm"]["speculative_config"])

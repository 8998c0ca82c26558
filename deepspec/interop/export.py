"""The export-checkpoint command: write a deepspec drafter in a layout that other
tools load (docs/FORMATS.md gives each layout with its sources).

* ``deepspec``: DeepSeek's DeepSpec layout (`<X>DSparkModel` for DFlash, with
  markov_rank 0, and DSpark; `<X>Eagle3Model`; X = Qwen3 or Gemma4), the exact
  inverse of `convert-checkpoint`: the drafter's tensors under the reference's
  names, frozen copies of the target's `embed_tokens` / `lm_head`, the
  reference's config fields. `--engine vllm` writes what vLLM's `method:
  "dspark"` loads (a DFlash drafter with a null Markov head, see
  NULL_MARKOV_RANK); `--engine sglang` what SGLang's DSPARK `Qwen3DSparkModel`
  loads, optionally with our STS temperatures and SPS(B) profile in SGLang's
  calibration and cost-table files (`sglang_files`).
* ``eagle3``: the EAGLE-3 / SpecForge layout that vLLM and SGLang serve: one
  decoder layer under `midlayer.*`, `fc`, `norm`, `lm_head` = the target head's
  rows of the draft vocabulary, `d2t` (target id - draft id) and `t2d` (bool),
  no `embed_tokens`; `architectures` Eagle3Qwen3ForCausalLM (Qwen3 layer) or
  LlamaForCausalLMEagle3 (Llama layer), and the feature layers in vLLM's
  convention (input of layer j: ours + 1).
* ``speculators``: the vllm-project/speculators format that `vllm serve DIR`
  configures itself from (`speculators_model_type: dspark`, the verifier, the
  number of speculative tokens, `sample_from_anchor: true` for DeepSpec's
  anchor-first block); the tensors of the vLLM `deepspec` export.

A drafter that a layout cannot represent is refused with one line before
anything is written (wrong layer family, depth, number of feature layers,
reduced vocabulary where the layout has none); `out` appears only complete.
Block drafters without a reserved mask token (a learned mask embedding) are
exported with `embed_tokens` row `mask_token_id` overwritten by that embedding,
and the config says so (`convert.MASK_ROW_FIELD`); for vLLM the embedding becomes
a new row V instead (MASK_APPENDED_FIELD), overwriting no token.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch

from ..errors import DeepSpecError
from ..fetch import not_a_hub_id
from ..files import atomic_dir, check_overwrite
from .convert import (MASK_APPENDED_FIELD, MASK_ROW_FIELD, NOT_IN_CHECKPOINT, NULL_MARKOV_FIELD, NULL_MARKOV_TENSORS,
                      check_out_apart, embed_scale, to_reference)

log = logging.getLogger(__name__)

FORMATS = ("deepspec", "eagle3", "speculators")
PREFIX = {"qwen3": "Qwen3", "gemma4_text": "Gemma4", "gemma4_unified_text": "Gemma4"}  # DeepSpec's classes exist for these
ENGINES = ("vllm", "sglang")
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
# MASK_APPENDED_FIELD: a block drafter with a learned mask embedding (a target without a
# reserved token, such as SmolLM2) for vLLM: the mask becomes token V, one past the target's vocabulary, in
# the drafter's own input embedding of V + 1 rows (the target's rows, then the learned
# one; markov_w1 gets a zero row V). vLLM's Qwen3 DSpark loads such an "expanded input
# vocabulary" with its own embed_tokens and never shares the target's
# (qwen3_dspark.py load_weights, v1/worker/gpu/spec_decode/dspark/utils.py
# load_dspark_model), so no token's embedding is overwritten.

# SGLang's DSPARK loads these files (docs/FORMATS.md §1.3), written beside the weights.
SGLANG_STS_FILE, SGLANG_SPS_FILE = "sglang_sts.json", "sglang_sps.json"
EAGLE3_ARCH = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "LlamaForCausalLMEagle3"}
# SGLang's requests in flight by default (ServerArgs.max_running_requests, 0.5.23): its
# DSPARK planner verifies up to requests x (gamma + 1) tokens a step (speculative_hook.py)
SGLANG_RUNNING_REQUESTS = 48


def _base_config(d) -> dict:
    """The draft layers' config without deepspec's own fields."""
    c = {k: v for k, v in d.config.to_dict().items() if not k.startswith("deepspec_")}
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        c.pop(k, None)
    return dict(c, tie_word_embeddings=False)


def _refuse(what: str, why: str):
    raise DeepSpecError(f"cannot export {what}: {why}")


def _qwen3_block_only(d, eagle3_as: str, eagle3_why: str, family_as: str, family_why: str) -> None:
    """Refuse an Eagle3 drafter, or draft layers other than Qwen3's, for a layout of Qwen3 block drafters."""
    if d.method == "eagle3":
        _refuse(f"an Eagle3 drafter {eagle3_as}", eagle3_why)
    if d.config.model_type != "qwen3":
        _refuse(f"a {d.config.model_type} drafter {family_as}", family_why)


# ----------------------------------------------------------------------------------------------
# the deepspec (reference) layout


def _mask_token(d, target, mask_token_id, engine=None):
    """(mask id, how its embedding is written: None = the target's row, "row" = a
    target row overwritten, "appended" = a new row V) of a block drafter."""
    mid = d.config.deepspec_mask_token_id
    if mid is not None:
        with torch.no_grad():
            ref = target.embed_tokens(torch.tensor([mid], device=target.embed_tokens.weight.device))[0]
        if not torch.equal(ref.float().cpu(), d.mask_embedding.detach().float().cpu()):
            _refuse("the mask embedding", f"it is not the target's embedding of mask_token_id {mid}")
        return mid, None
    if engine == "vllm":  # see MASK_APPENDED_FIELD
        if mask_token_id is not None:
            _refuse("for vLLM with --mask-token-id", "a learned mask embedding goes into a new row V of the "
                    "drafter's own input vocabulary, overwriting no token")
        return int(target.vocab_size), "appended"
    mid = int(target.vocab_size) - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mid < target.vocab_size:
        _refuse("the mask embedding", f"mask token {mid} is outside the target vocabulary")
    return mid, "row"


def _check_for_vllm(d) -> None:
    """What vLLM's Qwen3/Gemma4 DSpark loaders would load wrongly, refused in one line."""
    c, gemma4 = d.config, d.config.model_type != "qwen3"
    if d.method == "eagle3":
        _refuse("an Eagle3 drafter as deepspec for vLLM", "vLLM serves Eagle3 from the eagle3 layout (--format eagle3)")
    if c.deepspec_markov_rank > 0 and c.deepspec_markov_head_type != "vanilla":
        _refuse("for vLLM", f"vLLM's DSpark implements the vanilla Markov head only, this drafter's is "
                f"{c.deepspec_markov_head_type!r} (its weights would be rejected or, for Gemma4, ignored)")
    if c.deepspec_mask_token_id is None and gemma4:
        _refuse("a Gemma4 drafter for vLLM", "this drafter has a learned mask embedding, and vLLM's Gemma4 DSpark "
                "has no input vocabulary of its own to carry it: train with drafter.mask_token_id")
    if gemma4 and d.reduced_vocab:
        _refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark has a full-vocabulary head only")
    if gemma4 and not getattr(c, "attention_k_eq_v", False):
        _refuse("a Gemma4 drafter for vLLM", "vLLM's Gemma4 DSpark requires attention_k_eq_v in every draft layer")


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
            _refuse("a Gemma4 drafter for vLLM", f"the export {what} {', '.join(names[:3])}"
                    f"{' ...' if len(names) > 3 else ''}, which vLLM's Gemma4 DSpark loader "
                    f"{'skips' if what == 'has' else 'would leave at initialisation'} silently")


def deepspec_layout(d, target, mask_token_id=None, engine=None):
    """(config dict, tensors) of drafter d in DeepSeek's layout; engine "vllm" /
    "sglang": the fields that engine's DSpark loader reads, refusing what it would
    load wrongly (vLLM: DFlash gets a null Markov head, NULL_MARKOV_RANK)."""
    c = d.config
    family = c.model_type
    if family not in PREFIX:
        _refuse(f"a {family} drafter as deepspec", "DeepSpec has Qwen3 and Gemma4 drafter classes only")
    if engine == "sglang":
        _check_for_sglang(d)
    elif engine == "vllm":
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


# ----------------------------------------------------------------------------------------------
# SGLang's DSPARK (python/sglang/srt/models/dspark.py, sglang 0.5.23; docs/FORMATS.md §1.3)


def _check_for_sglang(d) -> None:
    """What SGLang's Qwen3DSparkModel cannot load, or would load wrongly, refused in one line."""
    c = d.config
    _qwen3_block_only(d, "as deepspec for SGLang", "SGLang serves Eagle3 from the eagle3 layout (--format eagle3, "
                      "Llama layer)", "for SGLang", "SGLang's DSPARK draft class is Qwen3DSparkModel (Qwen3 layers) only")
    if c.deepspec_markov_rank == 0:
        _refuse("a DFlash drafter (markov_rank 0) for SGLang", "SGLang's DSPARK requires markov_rank > 0 and its "
                "DFLASH runs z-lab's block (anchor = bonus token), not DeepSpec's anchor-first block")
    if d.reduced_vocab:
        _refuse("for SGLang", "SGLang's DSpark projects through the target's full lm_head and builds markov_w2 over "
                "the full vocabulary; this drafter has a reduced draft vocabulary")
    if c.deepspec_mask_token_id is None:
        _refuse("for SGLang", "this drafter has a learned mask embedding, which SGLang replaces by the target's "
                "embedding of mask_token_id (it skips embed_tokens): train with drafter.mask_token_id")
    if min(c.deepspec_feature_layers) < 0:
        _refuse("for SGLang", f"feature layer {min(c.deepspec_feature_layers)} (the embeddings): SGLang's "
                "target_layer_ids must lie in [0, target layers)")


def sglang_dspark_tensors(cfg: dict) -> dict[str, tuple]:
    """Name -> shape of every tensor SGLang's Qwen3DSparkModel (sglang 0.5.23,
    models/dspark.py + models/dflash.py DFlashDraftModel) loads from a checkpoint
    of config `cfg`. Its backbone loader ignores unknown names and leaves missing
    ones at their initial value, both silently, so an export must hold exactly these
    (plus `embed_tokens.weight` / `lm_head.weight`, which it skips by design)."""
    d, H, Hkv, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or d // H
    V, r, m = cfg["vocab_size"], int(cfg["markov_rank"]), len(cfg["target_layer_ids"])
    out = {"fc.weight": (d, m * d), "hidden_norm.weight": (d,), "norm.weight": (d,),
           "markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (H * hd, d), p + "self_attn.k_proj.weight": (Hkv * hd, d),
                    p + "self_attn.v_proj.weight": (Hkv * hd, d), p + "self_attn.o_proj.weight": (d, H * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, d), p + "mlp.up_proj.weight": (I, d), p + "mlp.down_proj.weight": (d, I),
                    p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    kind = cfg.get("markov_head_type", "vanilla")
    if kind == "rnn":
        out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    elif kind == "gated":
        out.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
    if cfg.get("enable_confidence_head"):
        out.update({"confidence_head.proj.weight": (1, d + (r if cfg.get("confidence_head_with_markov") else 0)),
                    "confidence_head.proj.bias": (1,)})
    return out


def _check_sglang(cfg: dict, sd: dict) -> None:
    want = dict(sglang_dspark_tensors(cfg), **{"embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"]),
                                               "lm_head.weight": (cfg["vocab_size"], cfg["hidden_size"])})
    have = {k: tuple(v.shape) for k, v in sd.items()}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            _refuse("for SGLang", f"tensor {name}: SGLang's Qwen3DSparkModel expects {want.get(name)}, the export "
                    f"has {have.get(name)} (its loader drops or misses such names silently)")


def _read_alg1(path, what: str) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise DeepSpecError(f"--{what} {p}: no such file (a schedule rule's <benchmark>.alg1.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DeepSpecError(f"--{what} {p}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise DeepSpecError(f"--{what} {p}: not a schedule rule's alg1.json (no object)")
    return data


def _ece_columns(alg1_path: Path, gamma: int) -> dict:
    """ece_before / ece_after per position from the schedule rule's calibration.csv
    beside alg1.json (written together), when present and finite."""
    import csv
    import math

    cal = alg1_path.with_name(alg1_path.name.replace(".alg1.json", ".calibration.csv"))
    if cal == alg1_path or not cal.exists():
        log.warning("no %s beside %s: the STS file has no ECE before/after", cal.name, alg1_path)
        return {}
    with cal.open(newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda row: int(row["position"]))
    try:
        out = {k: [float(row[k]) for row in rows] for k in ("ece_before", "ece_after")}
    except (KeyError, ValueError):
        raise DeepSpecError(f"{cal}: no numeric ece_before / ece_after columns") from None
    if any(len(v) != gamma or not all(math.isfinite(x) for x in v) for v in out.values()):
        log.warning("%s: ECE not finite at every one of the %d positions: the STS file has no ECE", cal, gamma)
        return {}
    return out


def sglang_files(d, sts=None, sps=None) -> dict[str, dict]:
    """SGLang's DSPARK calibration and cost files from a schedule rule's alg1.json:
    `sts` -> SGLANG_STS_FILE (DSparkStsCalibration: per-position `temperatures`,
    `dataset`, `num_samples`, `ece_before`, `ece_after`; applied as
    sigmoid(logit / T_k), the same scaling as our `calibration.apply_sts`),
    `sps` -> SGLANG_SPS_FILE (SpsCostTable: `sample_batch_tokens` increasing,
    `sample_steps_per_sec`, `max_batch_tokens`; the verify budget's steps per second
    at B verified tokens, our SPS(B))."""
    import math

    gamma = int(d.config.deepspec_block_size)
    files = {}
    if (sts or sps) and getattr(d, "confidence", None) is None:
        _refuse("--sts/--sps for SGLang", "this drafter has no confidence head: SGLang ignores STS and the SPS table "
                "without one (its budget needs confidences)")
    if sts:
        a = _read_alg1(sts, "sts")
        temps = a.get("sts_temperatures")
        if not isinstance(temps, list) or len(temps) != gamma or not all(
                isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps):
            _refuse(f"--sts {sts}", f"sts_temperatures must be {gamma} positive numbers (one per draft position, "
                    f"the block size), not {temps!r}")
        files[SGLANG_STS_FILE] = {"temperatures": [float(t) for t in temps], "dataset": str(a.get("benchmark", "")),
                                  "num_samples": int(a.get("n_rounds_fit", 0)), **_ece_columns(Path(sts), gamma)}
    if sps:
        a = _read_alg1(sps, "sps")
        curve = a.get("sps") if isinstance(a.get("sps"), dict) else {}
        B, S = curve.get("batch_tokens"), curve.get("steps_per_s")
        ok = isinstance(B, list) and isinstance(S, list) and len(B) == len(S) > 0
        ok = ok and all(isinstance(b, int) and b >= 1 for b in B) and B == sorted(set(B))
        ok = ok and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in S)
        if not ok:
            _refuse(f"--sps {sps}", "sps.batch_tokens must be increasing integers >= 1 with one positive "
                    "sps.steps_per_s each")
        if max(B) < gamma + 1:
            _refuse(f"--sps {sps}", f"the SPS table ends at {max(B)} tokens, short of one request's {gamma + 1} "
                    "(SGLang would clamp every step to it): profile to more (schedule --max-batch-tokens)")
        files[SGLANG_SPS_FILE] = {"sample_batch_tokens": B, "sample_steps_per_sec": [float(x) for x in S],
                                  "max_batch_tokens": max(B)}
    return files


# ----------------------------------------------------------------------------------------------
# the speculators format (vllm-project/speculators; vLLM transformers_utils/configs/speculators/)


def speculators_layout(d, target, mask_token_id=None, verifier=None):
    """(config dict, tensors) of a DSpark / DFlash drafter in the speculators format
    vLLM 0.32 configures `vllm serve DIR` from (docs/FORMATS.md §3): the tensors of
    the vLLM deepspec export, the draft layers' config as `transformer_layer_config`,
    the algorithm fields at the top level."""
    c = d.config
    _qwen3_block_only(d, "as speculators", "this export writes DFlash/DSpark drafters (speculators_model_type dspark); "
                      "vLLM reads Eagle3 from --format eagle3", "as speculators",
                      "vLLM maps speculators-format DSpark to Qwen3DSparkModel (Qwen3 draft layers) only")
    ref, sd = deepspec_layout(d, target, mask_token_id, engine="vllm")
    layer = {k: v for k, v in _base_config(d).items() if k != "architectures"}
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
               deepspec_feature_layers=layers, deepspec_ttt_length=int(c.deepspec_ttt_length))
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


def export_drafter(d, target, fmt: str, out, *, overwrite: bool = False, mask_token_id=None, engine=None,
                   sts=None, sps=None, verifier=None, card=None, attach=()) -> Path:
    """Write drafter d (attached to target) in layout `fmt` at `out`, atomically;
    `engine` (vllm, sglang): refuse what that engine would load wrongly. `sts` / `sps`
    (SGLang only): a schedule rule's alg1.json whose STS temperatures / SPS(B) curve
    are written as SGLang's files (`sglang_files`); `verifier` (speculators): the
    target's name or path recorded for `vllm serve` (default: the drafter's target id).
    `card(config, out)`: the README.md written beside the weights (`model_card`);
    `attach`: files copied in as they are (the run's provenance.json)."""
    from safetensors.torch import save_file

    out = Path(out)
    if fmt not in FORMATS:
        raise DeepSpecError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if engine not in (None, *ENGINES):
        raise DeepSpecError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if (sts or sps) and not (fmt == "deepspec" and engine == "sglang"):
        raise DeepSpecError("--sts/--sps write SGLang's calibration and cost files: use --format deepspec --engine sglang")
    if verifier and fmt != "speculators":
        raise DeepSpecError("--verifier names the target in a speculators-format export: use --format speculators")
    if fmt == "speculators" and engine not in (None, "vllm"):
        raise DeepSpecError(f"the speculators format is read by vLLM, not {engine} (SGLang: --format deepspec --engine sglang)")
    check_overwrite(out, overwrite)  # before the work: only a deepspec output may be replaced
    files = {}
    if fmt == "deepspec":
        cfg, sd = deepspec_layout(d, target, mask_token_id, engine)
        if engine == "vllm" and cfg["architectures"] == ["Gemma4DSparkModel"]:
            check_vllm_gemma4_names(cfg, sd)
        if engine == "sglang":
            _check_sglang(cfg, sd)
            files = sglang_files(d, sts, sps)
            cfg["deepspec_serve_sglang"] = _sglang_serve(d, files)
    elif fmt == "speculators":
        cfg, sd = speculators_layout(d, target, mask_token_id, verifier)
    else:
        cfg, sd = eagle3_layout(d, target)
        if engine == "sglang" and cfg["architectures"] != [EAGLE3_ARCH["llama"]]:
            _refuse("as eagle3 for SGLang", "SGLang's EAGLE-3 draft class is LlamaForCausalLMEagle3 (Llama layer) only")
        _check_eagle3(cfg, sd)
    cfg["deepspec_exported_from"] = {"target": d.config.deepspec_target_id, "method": d.method, "format": fmt}
    if engine == "vllm" or fmt == "speculators":
        cfg["deepspec_exported_from"].update(vllm_versions())
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        for extra in attach:
            shutil.copyfile(extra, tmp / Path(extra).name)
        if card is not None:
            (tmp / "README.md").write_text(card(cfg, out))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    log.info("exported %s drafter as %s (%d tensors) -> %s", d.method, fmt, len(sd), out)
    _log_serve(cfg, out)
    return out


def vllm_versions() -> dict:
    """The vLLM series the export was tested with and the vLLM found beside this
    environment (None when there is none); an untested one is refused in one line."""
    from .engine_env import VLLM_VERSION, check_vllm_version, installed_vllm_version, vllm_python

    try:
        py = vllm_python()
    except DeepSpecError:
        return {"vllm_tested": VLLM_VERSION, "vllm_found": None}
    return {"vllm_tested": VLLM_VERSION, "vllm_found": check_vllm_version(installed_vllm_version(py), py)}


def _sglang_serve(d, files: dict) -> dict:
    """SGLang's server settings for this export (recorded in its config, logged)."""
    serve = {"speculative_algorithm": "DSPARK", "speculative_dspark_block_size": int(d.config.deepspec_block_size)}
    if SGLANG_STS_FILE in files:
        serve["speculative_dspark_confidence_sts_path"] = SGLANG_STS_FILE
    if SGLANG_SPS_FILE in files:
        serve["speculative_dspark_sps_table_path"] = SGLANG_SPS_FILE
    if getattr(d, "confidence", None) is None:
        # no confidence head: SGLang's other verify modes build one and raise on its missing weights
        serve["env"] = {"SGLANG_RAGGED_VERIFY_MODE": "static"}
    elif files:  # the confidence-scheduled (ragged) verification reads them; the default mode, static, does not
        serve["env"] = {"SGLANG_RAGGED_VERIFY_MODE": "compact"}
    if SGLANG_SPS_FILE in files:
        # SGLang looks SPS(B) up by floor and clamps past the table's last entry, so beyond it every
        # candidate looks free and it verifies everything: cap the requests at what the table spans
        gamma = int(d.config.deepspec_block_size)
        n = files[SGLANG_SPS_FILE]["max_batch_tokens"] // (gamma + 1)
        serve["max_running_requests"] = n
        if n < SGLANG_RUNNING_REQUESTS:
            log.warning("the SPS table spans %d verified tokens, %d requests of %d: served with "
                        "--max-running-requests %d (SGLang's default %d needs a table to %d tokens: schedule "
                        "--max-batch-tokens %d on the serving GPU)", n * (gamma + 1), n, gamma + 1, n,
                        SGLANG_RUNNING_REQUESTS, SGLANG_RUNNING_REQUESTS * (gamma + 1), SGLANG_RUNNING_REQUESTS * (gamma + 1))
    return serve


def serve_commands(cfg: dict, out, target: str = "<target>") -> dict[str, str]:
    """The command line that serves export `out` (its config `cfg`) per engine that
    reads its layout: vLLM for every vLLM-bound layout, SGLang for `--engine sglang`
    exports and Llama-layer EAGLE-3 ones. `target`: the served model (the export's
    verifier where the format names one)."""
    out, cmds = str(out), {}
    vllm = cfg.get("deepspec_serve_vllm", {})
    if cfg.get("speculators_model_type"):
        if "model" in vllm:  # a local verifier: vLLM >= 0.34 refuses `vllm serve DIR`
            cmds["vllm"] = f"vllm serve {vllm['model']} --speculative-config '{json.dumps(dict(vllm['speculative_config'], model=out))}'"
        else:
            cmds["vllm"] = f"vllm serve {out} --speculative-config '{json.dumps(vllm['speculative_config'])}'"
    elif vllm:
        cmds["vllm"] = f"vllm serve {target} --speculative-config '{json.dumps(dict(vllm['speculative_config'], model=out))}'"
    elif cfg.get("architectures", [None])[0] in EAGLE3_ARCH.values():
        spec = {"model": out, "method": "eagle3", "num_speculative_tokens": int(cfg.get("deepspec_ttt_length", 7)),
                "draft_sample_method": "probabilistic"}
        cmds["vllm"] = f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"
        if cfg["architectures"] == [EAGLE3_ARCH["llama"]]:
            k = spec["num_speculative_tokens"]
            cmds["sglang"] = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                              f"--speculative-draft-model-path {out} --speculative-num-steps {k} "
                              f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    if "deepspec_serve_sglang" in cfg:
        serve = dict(cfg["deepspec_serve_sglang"])
        env = " ".join(f"{k}={v}" for k, v in serve.pop("env", {}).items())
        args = " ".join(f"--{k.replace('_', '-')} {Path(out) / v if str(v).endswith('.json') else v}"
                        for k, v in serve.items())
        cmds["sglang"] = (f"{env + ' ' if env else ''}python -m sglang.launch_server --model-path {target} "
                          f"--speculative-draft-model-path {out} {args}")
    return cmds


def _log_serve(cfg: dict, out: Path) -> None:
    vllm = cfg.get("deepspec_serve_vllm", {})
    if cfg.get("speculators_model_type") and "model" in vllm:
        log.warning("the verifier %s is local: vLLM >= 0.34 refuses `vllm serve %s`; serve the target with the "
                    "drafter as its speculative model (vLLM 0.32 and 0.34 alike)", vllm["model"], out)
    for engine, cmd in serve_commands(cfg, out).items():
        log.info("serve with (%s): %s", engine, cmd)


def cli_export_checkpoint(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(prog="deepspec export-checkpoint",
                                description="write a deepspec drafter in DeepSeek's (deepspec) or the EAGLE-3 layout")
    add_config_args(p)
    p.add_argument("--src", required=True, help="deepspec drafter directory (train or convert-checkpoint output)")
    p.add_argument("--format", required=True, choices=FORMATS, help="deepspec (DeepSpec, vLLM dspark, SGLang DSPARK), "
                   "eagle3 (SpecForge, vLLM and SGLang eagle3) or speculators (vllm serve DIR)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="block drafters with a learned mask embedding: the embed_tokens row to overwrite (default V-1)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="the engine that will serve the export: refuse what it would load wrongly (vllm: vanilla "
                        "Markov head, reserved mask token; allows Qwen3 reduced vocabularies; sglang: Qwen3 DSpark, "
                        "full vocabulary, reserved mask token)")
    p.add_argument("--sts", help="with --engine sglang: a schedule rule's <benchmark>.alg1.json; its STS temperatures "
                   "(and the ECE of the calibration.csv beside it) become SGLang's " + SGLANG_STS_FILE)
    p.add_argument("--sps", help="with --engine sglang: a schedule rule's alg1.json; its SPS(B) curve becomes "
                   "SGLang's " + SGLANG_SPS_FILE + " (profile on the serving hardware)")
    p.add_argument("--verifier", help="--format speculators: the target's hub id or path that vllm serve loads "
                   "(default: the preset's target)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    check_out_apart(args.src, args.out)
    cfg = config_from_args(args)
    from ..drafters import load_drafter
    from ..targets.loading import target_from_config

    from ..paths import RunPaths
    from .model_card import model_card

    target = target_from_config(cfg)
    d = load_drafter(args.src, target)
    prov = RunPaths.of(cfg).provenance()
    export_drafter(d, target, args.format, args.out, overwrite=args.overwrite, mask_token_id=args.mask_token_id,
                   engine=args.engine, sts=args.sts, sps=args.sps, verifier=args.verifier,
                   card=lambda ecfg, out: model_card(cfg, d, ecfg, out, args.format, args.engine, args.src,
                                                     serve_commands),
                   attach=[prov] if prov.exists() else [])
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

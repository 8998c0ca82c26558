"""SGLang's DSPARK (python/sglang/srt/models/dspark.py, sglang 0.5.23;
docs/FORMATS.md §1.3): what its Qwen3DSparkModel loads, and its calibration (STS)
and cost-table (SPS) files from a schedule rule's alg1.json."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import DeepSpecError
from .common import qwen3_block_only, refuse

log = logging.getLogger(__name__)

# SGLang's DSPARK loads these files (docs/FORMATS.md §1.3), written beside the weights.
SGLANG_STS_FILE, SGLANG_SPS_FILE = "sglang_sts.json", "sglang_sps.json"


# SGLang's requests in flight by default (ServerArgs.max_running_requests, 0.5.23): its
# DSPARK planner verifies up to requests x (gamma + 1) tokens a step (speculative_hook.py)
SGLANG_RUNNING_REQUESTS = 48



def check_for_sglang(d) -> None:
    """What SGLang's Qwen3DSparkModel cannot load, or would load wrongly, refused in one line."""
    c = d.config
    qwen3_block_only(d, "as deepspec for SGLang", "SGLang serves Eagle3 from the eagle3 layout (--format eagle3, "
                      "Llama layer)", "for SGLang", "SGLang's DSPARK draft class is Qwen3DSparkModel (Qwen3 layers) only")
    if c.deepspec_markov_rank == 0:
        refuse("a DFlash drafter (markov_rank 0) for SGLang", "SGLang's DSPARK requires markov_rank > 0 and its "
                "DFLASH runs z-lab's block (anchor = bonus token), not DeepSpec's anchor-first block")
    if d.reduced_vocab:
        refuse("for SGLang", "SGLang's DSpark projects through the target's full lm_head and builds markov_w2 over "
                "the full vocabulary; this drafter has a reduced draft vocabulary")
    if c.deepspec_mask_token_id is None:
        refuse("for SGLang", "this drafter has a learned mask embedding, which SGLang replaces by the target's "
                "embedding of mask_token_id (it skips embed_tokens): train with drafter.mask_token_id")
    if min(c.deepspec_feature_layers) < 0:
        refuse("for SGLang", f"feature layer {min(c.deepspec_feature_layers)} (the embeddings): SGLang's "
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



def check_sglang(cfg: dict, sd: dict) -> None:
    want = dict(sglang_dspark_tensors(cfg), **{"embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"]),
                                               "lm_head.weight": (cfg["vocab_size"], cfg["hidden_size"])})
    have = {k: tuple(v.shape) for k, v in sd.items()}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            refuse("for SGLang", f"tensor {name}: SGLang's Qwen3DSparkModel expects {want.get(name)}, the export "
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
        refuse("--sts/--sps for SGLang", "this drafter has no confidence head: SGLang ignores STS and the SPS table "
                "without one (its budget needs confidences)")
    if sts:
        a = _read_alg1(sts, "sts")
        temps = a.get("sts_temperatures")
        if not isinstance(temps, list) or len(temps) != gamma or not all(
                isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps):
            refuse(f"--sts {sts}", f"sts_temperatures must be {gamma} positive numbers (one per draft position, "
                    f"the block size), not {temps!r}")
        files[SGLANG_STS_FILE] = {"temperatures": [float(t) for t in temps], "dataset": str(a.get("benchmark", "")),
                                  "num_samples": int(a.get("n_rounds_fit", 0)), **_ece_columns(Path(sts), gamma)}
    if sps:
        a = _read_alg1(sps, "sps")
        curve = a.get("sps") if isinstance(a.get("sps"), dict) else {}
        B, S = curve.get("batch_tokens"), curve.get("steps_per_s")
        ok = isinstance(B, list) and isinstance(S, list) and len(B) == len(S) > 0
        # whole numbers, written as 1 or 1.0 (schedule wrote floats before it wrote ints)
        ok = ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                        and b == int(b) and b >= 1 for b in B)
        B = [int(b) for b in B] if ok else B
        ok = ok and B == sorted(set(B))
        ok = ok and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in S)
        if not ok:
            refuse(f"--sps {sps}", "sps.batch_tokens must be increasing integers >= 1 with one positive "
                    "sps.steps_per_s each")
        if max(B) < gamma + 1:
            refuse(f"--sps {sps}", f"the SPS table ends at {max(B)} tokens, short of one request's {gamma + 1} "
                    "(SGLang would clamp every step to it): profile to more (schedule --max-batch-tokens)")
        files[SGLANG_SPS_FILE] = {"sample_batch_tokens": B, "sample_steps_per_sec": [float(x) for x in S],
                                  "max_batch_tokens": max(B)}
    return files



def sglang_serve(d, files: dict) -> dict:
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

"""The convert-checkpoint command: load DeepSeek's released Eagle3 / DFlash / DSpark drafters (the
reference DeepSpec layout of its deepspec/modeling/{dspark,eagle3}/; docs/FORMATS.md) into deepspec drafters.

An Eagle3 checkpoint (`architectures: [Qwen3Eagle3Model | Gemma4Eagle3Model]`,
`target_layer_ids`, `ttt_length`, `num_hidden_layers`) has exactly our Eagle3's names
(`fc`, `layers.{i}.*` of the standard EAGLE-3 layer, `norm`; Gemma4 `layer_scalar`)
plus frozen copies of the target's `embed_tokens` / `lm_head`, checked and dropped.

A DFlash/DSpark reference checkpoint is a HF directory: `config.json` (the target's config plus
`architectures: [<X>DSparkModel]`, `num_hidden_layers` = draft layers,
`num_target_layers`, `block_size`, `target_layer_ids`, `mask_token_id`,
`markov_rank` (0 for DFlash), `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`) and safetensors weights (one file, or shards
listed in `model.safetensors.index.json`) with top-level names. The mapping:

    fc, hidden_norm, layers.*, norm          -> same names
    markov_head.markov_w1.weight [V, r]      -> markov.embed.weight (W1)
    markov_head.markov_w2.weight [V, r]      -> markov.out.weight   (W2)
    markov_head.joint_proj.{weight,bias}     -> markov.cell.*       (RNN head; same
                                                [s; W1[x]; h] -> [gate; cand; out] order)
    confidence_head.proj.{weight,bias}       -> confidence.proj.*   (ConfidenceHead)
    layers.{i}.layer_scalar [1] (Gemma4)     -> layers.{i}.layer_scalar (the reference
                                                layer's output scale, a buffer of ones
                                                at init; ones when a checkpoint lacks it)
    embed_tokens.weight, lm_head.weight      -> not stored: frozen copies of the
                                                target's, checked against it
    (nothing)                                -> mask_embedding = the target's embedding
                                                of `mask_token_id`; d2t = arange(V)
    markov_head.* of a null head             -> dropped (NULL_MARKOV_FIELD: the vLLM form
                                                of a DFlash drafter, all zeros)

The reference block input is the frozen embedding of a reserved token
(`mask_token_id`, 151669 on Qwen3, 4 on Gemma4); writing that embedding into our
learned `mask_embedding` gives the same function at inference (and the converted
drafter records the token, `deepspec_mask_token_id`). An export of a drafter with a
learned mask embedding (`MASK_ROW_FIELD`) carries it in that `embed_tokens` row.

The architecture fields of the checkpoint are checked against the draft config
deepspec builds for the target (`drafters.base.draft_config`), which the
converted drafter must match. On Gemma4 that is the target's full-attention
geometry: the reference config is the target's text config, so its `head_dim` /
`num_key_value_heads` are the sliding layers' and its draft layers use
`global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`
(or, when written by a transformers that folds these into `per_layer_config`,
the full-attention entries there); rope_theta is the full-attention one.

Entry point: `convert_reference_checkpoint(src, target, out)`; formats/released.py
resolves a released drafter (a directory or hub id) through it and holds the
`python -m deepspec convert-checkpoint` command.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from ..errors import DeepSpecError, first_line
from ..files import atomic_dir, check_overwrite, read_json
from ..provenance import SOURCE_FILE, read_record, snapshot_commit

log = logging.getLogger(__name__)

RENAMES = (  # reference prefix -> deepspec prefix
    ("markov_head.markov_w1.", "markov.embed."),
    ("markov_head.markov_w2.", "markov.out."),
    ("markov_head.joint_proj.", "markov.cell."),
    ("confidence_head.", "confidence."),
)
TARGET_COPIES = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
NOT_IN_CHECKPOINT = ("mask_embedding", "d2t")
# config fields that must agree with the target's (text) config when both have them
ARCH_FIELDS = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta")


def to_ours(name: str) -> str:
    for ref, ours in RENAMES:
        if name.startswith(ref):
            return ours + name[len(ref):]
    return name


def to_reference(name: str) -> str:
    for ref, ours in RENAMES:
        if name.startswith(ours):
            return ref + name[len(ours):]
    return name


# ----------------------------------------------------------------------------------------------
# reading


def read_reference_config(src: Path) -> dict:
    path = src / "config.json"
    ref = read_json(path, f"no checkpoint at {src} (config.json missing)")
    if "deepspec_method" in ref:
        raise DeepSpecError(f"{path}: already a deepspec drafter, nothing to convert")
    arch = (ref.get("architectures") or ["?"])[0]
    eagle3 = arch.endswith("Eagle3Model")
    if not (eagle3 or arch.endswith("DSparkModel")):
        raise DeepSpecError(f"{path}: architecture {arch!r} is not a DeepSpec Eagle3/DFlash/DSpark drafter")
    need = ("num_hidden_layers", "target_layer_ids", "hidden_size", "vocab_size")
    need += () if eagle3 else ("block_size", "mask_token_id", "markov_rank")
    for key in need:
        if key not in ref:
            raise DeepSpecError(f"{path}: field {key!r} missing")
    return ref


def check_out_apart(src, out) -> None:
    """Refuse an output directory that is, contains or lies inside the source
    directory: writing (or --overwrite replacing) it would delete the source."""
    s, o = Path(src).resolve(), Path(out).resolve()
    how = "is" if o == s else "lies inside" if s in o.parents else "contains" if o in s.parents else None
    if how:
        raise DeepSpecError(f"--out {out} {how} --src {src}: writing it would delete or change the source; "
                            "give an output directory outside the source")


@contextlib.contextmanager
def _safe_open(path: Path):
    """safetensors' safe_open, a damaged file (truncated, bad header) a one-line error naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        msg = first_line(e)
        raise DeepSpecError(f"{path}: not a readable safetensors file (truncated or damaged: {msg})") from None


def tensor_files(src: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (single file, or shards via the index)."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DeepSpecError(f"{index}: malformed index (no weight_map)") from None
        files = {k: src / f for k, f in weight_map.items()}
        for k, f in files.items():
            if not f.exists():
                raise DeepSpecError(f"{index}: shard {f.name} of tensor {k!r} not found")
        return files
    single = src / "model.safetensors"
    if not single.exists():
        raise DeepSpecError(f"{src}: no model.safetensors or model.safetensors.index.json")
    with _safe_open(single) as f:
        return {k: single for k in f.keys()}


def _method(ref: dict) -> tuple[str, dict]:
    """deepspec method and drafter settings from a reference config (a null
    Markov head, NULL_MARKOV_FIELD, counts as markov_rank 0)."""
    if ref["architectures"][0].endswith("Eagle3Model"):
        return "eagle3", {
            "num_layers": {"eagle3": int(ref["num_hidden_layers"])}, "block_size": 7,
            "ttt_length": int(ref.get("ttt_length", 7)), "markov_rank": 0, "markov_head_type": "vanilla",
            "confidence_head": False, "confidence_with_markov": False, "draft_vocab_size": None,
            "init_from_target": False, "mask_token_id": None,
        }
    r = 0 if ref.get(NULL_MARKOV_FIELD) else int(ref["markov_rank"])
    conf = bool(ref.get("enable_confidence_head", False))
    kind = str(ref.get("markov_head_type", "vanilla")).lower()
    if r > 0 and kind not in ("vanilla", "rnn"):
        raise DeepSpecError(f"markov_head_type {kind!r} is not supported (deepspec has vanilla and rnn)")
    method = "dspark" if r > 0 or conf else "dflash"
    drafter = {
        "num_layers": {method: int(ref["num_hidden_layers"])}, "block_size": int(ref["block_size"]),
        "ttt_length": 7, "markov_rank": r, "markov_head_type": kind, "confidence_head": conf,
        "confidence_with_markov": bool(ref.get("confidence_head_with_markov", False)),
        "draft_vocab_size": None, "init_from_target": False, "mask_token_id": int(ref["mask_token_id"]),
    }
    return method, drafter


def _rope_theta(cfg: dict):
    """rope_theta, flat or in rope_parameters; per layer type (Gemma4): full attention's."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    return cfg.get("rope_theta", rp.get("rope_theta") if isinstance(rp, dict) else None)


def _reference_arch(ref: dict, gemma4: bool) -> dict:
    """ARCH_FIELDS of the reference's draft layers. A Gemma4 reference config is the
    target's text config: head_dim / num_key_value_heads there are the sliding
    layers'; the draft layers use global_head_dim and, with attention_k_eq_v,
    num_global_key_value_heads (newer transformers: per_layer_config's entries)."""
    arch = {key: _rope_theta(ref) if key == "rope_theta" else ref.get(key) for key in ARCH_FIELDS}
    if not gemma4:
        return arch
    if ref.get("global_head_dim") is not None:
        arch["head_dim"] = ref["global_head_dim"]
        if ref.get("attention_k_eq_v") and ref.get("num_global_key_value_heads") is not None:
            arch["num_key_value_heads"] = ref["num_global_key_value_heads"]
    else:
        plc = ref.get("per_layer_config")
        for entry in (plc.values() if isinstance(plc, dict) else ()):  # full-attention overrides (all equal)
            if isinstance(entry, dict):
                arch.update({k: entry[k] for k in ("head_dim", "num_key_value_heads") if k in entry})
    return arch


def reference_layer_arch(ref: dict, target) -> str:
    """The drafter.layer_arch a reference checkpoint was built with: "qwen3" for
    Qwen3 draft layers over a target of another architecture that may have them
    (e.g. a Qwen3DSparkModel speculator of a Llama target, as vLLM serves it),
    else "target"."""
    from ..architectures import OWN_LAYERS_ONLY, same_layers

    tt = target.text_config.model_type
    qwen3_over_other = ref.get("model_type") == "qwen3" and not same_layers("qwen3", tt)
    return "qwen3" if qwen3_over_other and tt not in OWN_LAYERS_ONLY else "target"


def check_reference_target(ref: dict, target, where: str, config=None) -> None:
    """The checkpoint's config against the target: model type (the target's, or
    Qwen3 draft layers, `reference_layer_arch`), depth, mask token, feature layers,
    and its architecture fields against `config`, the draft config deepspec builds
    for the target (built from `ref` when not given)."""
    from ..drafters.base import draft_config
    from ..drafters.blocks import blocks_for, same_layers

    tc = target.text_config
    mt = ref.get("model_type")
    layers = "qwen3" if reference_layer_arch(ref, target) == "qwen3" else tc.model_type
    if mt is not None and not (same_layers(mt, layers) or mt == getattr(target.config, "model_type", None)):
        raise DeepSpecError(f"{where}: a {ref['model_type']} drafter, the target {target.target_id!r} is {tc.model_type}")
    n = ref.get("num_target_layers")
    if n is not None and int(n) != int(target.num_layers):
        raise DeepSpecError(f"{where}: made for a {n}-layer target, {target.target_id!r} has {target.num_layers}")
    mid = ref.get("mask_token_id")
    if ref.get(MASK_APPENDED_FIELD):
        raise DeepSpecError(f"{where}: an export for vLLM whose learned mask embedding is an extra token "
                            f"{mid}: convert the plain deepspec export of that drafter instead")
    if mid is not None and not 0 <= int(mid) < int(target.vocab_size):
        raise DeepSpecError(f"{where}: mask_token_id {mid} is outside the target vocabulary")
    try:
        target.check_feature_layers(ref["target_layer_ids"])
    except DeepSpecError as e:
        raise DeepSpecError(f"{where}: target_layer_ids: {e}") from None
    if config is None:
        method, drafter_cfg = _method(ref)
        drafter_cfg["layer_arch"] = reference_layer_arch(ref, target)
        config = draft_config(method, target, drafter_cfg, ref["target_layer_ids"])
    # the draft config's own fields (Gemma4: homogeneous full-attention geometry, no
    # ambiguous per-layer attribute); hidden and vocab size as the target has them
    have = dict(config.to_dict(), hidden_size=int(target.hidden_size), vocab_size=int(target.vocab_size))
    have_arch = {key: _rope_theta(have) if key == "rope_theta" else have.get(key) for key in ARCH_FIELDS}
    ref_arch = _reference_arch(ref, blocks_for(config).family == "gemma4")
    for key in ARCH_FIELDS:
        a, b = ref_arch[key], have_arch[key]
        if a is not None and b is not None and a != b:
            raise DeepSpecError(f"{where}: {key} is {a!r} but the target {target.target_id!r} has {b!r}")


def _check_same(name: str, w: torch.Tensor, ref_w: torch.Tensor, where: str, rows: int = 8192,
                skip_row: int | None = None) -> None:
    """A checkpoint's copy of the target's embedding / LM head must be the target's
    (up to bf16 rounding): otherwise it was trained for another target. `skip_row`:
    a row the exporter overwrote with a learned mask embedding (MASK_ROW_FIELD)."""
    for i in range(0, w.shape[0], rows):
        a = w[i:i + rows].detach().float().cpu()
        b = ref_w[i:i + rows].float()
        if skip_row is not None and i <= skip_row < i + rows:
            a, b = a.clone(), b.clone()
            a[skip_row - i] = b[skip_row - i]
        if not torch.allclose(a, b, rtol=1e-2, atol=1e-4):
            raise DeepSpecError(f"{where}: {name} differs from the target's (from row {i}): made for another target?")


# A config field written by `export-checkpoint` when the drafter's learned mask
# embedding had no reserved token to stand for: embed_tokens row `mask_token_id`
# then holds that embedding (divided by the target's embedding scale) instead of
# the target's row.
MASK_ROW_FIELD = "deepspec_mask_row_overwritten"
MASK_APPENDED_FIELD = "deepspec_mask_row_appended"  # export.py: the learned mask as token V, for vLLM
# A config field written by `export-checkpoint --engine vllm` (and --format
# speculators) for a DFlash drafter: vLLM serves DeepSpec's anchor-first block only
# as a DSpark, so the export carries a null Markov head (markov_rank 1, both factors
# zero, a bias of exactly 0). Converting it back drops that head: a DFlash drafter.
NULL_MARKOV_FIELD = "deepspec_null_markov_head"
NULL_MARKOV_TENSORS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


def embed_scale(target) -> float:
    """The target embedding module's output scale (Gemma4: sqrt(d); else 1)."""
    s = getattr(target.embed_tokens, "embed_scale", 1.0)
    return float(s.item() if torch.is_tensor(s) else s)


def _read_tensors(src: Path, want: dict, target, method: str, mask_row: int | None, null_markov: bool = False):
    """The drafter's tensors of a reference checkpoint, checked against `want`
    (name -> shape); the target copies are checked, not kept, except the mask row
    of an overwritten embed_tokens (returned second, or None); `null_markov`: the
    Markov factors are checked to be zero and dropped (NULL_MARKOV_FIELD)."""
    files = tensor_files(src)
    if null_markov and not set(NULL_MARKOV_TENSORS) <= set(files):
        raise DeepSpecError(f"{src}: {NULL_MARKOV_FIELD} is set but the checkpoint lacks {', '.join(NULL_MARKOV_TENSORS)}")
    state: dict[str, torch.Tensor] = {}
    row = None
    for path in sorted(set(files.values())):
        with _safe_open(path) as f:
            present = set(f.keys())
            for name in sorted(k for k, v in files.items() if v == path):
                if name not in present:
                    raise DeepSpecError(f"{path}: tensor {name!r} listed in the index is not in the file")
                shape = tuple(f.get_slice(name).get_shape())
                if name in TARGET_COPIES:
                    w = getattr(target, TARGET_COPIES[name]).weight
                    if shape != tuple(w.shape):
                        raise DeepSpecError(f"{path}: {name} has shape {list(shape)}, the target's {list(w.shape)}")
                    skip = mask_row if name == "embed_tokens.weight" else None
                    t = f.get_tensor(name)
                    _check_finite(t, name, path)
                    _check_same(name, w, t, str(path), skip_row=skip)
                    row = t[skip].float() if skip is not None else row
                    continue
                if null_markov and name in NULL_MARKOV_TENSORS:
                    if bool(f.get_tensor(name).any()):
                        raise DeepSpecError(f"{path}: {NULL_MARKOV_FIELD} is set but {name} is not zero")
                    continue
                ours = to_ours(name)
                if ours not in want:
                    if name.endswith(".layer_scalar") and bool((f.get_tensor(name) == 1).all()):
                        continue  # an identity output scale, in a drafter whose layers have none
                    raise DeepSpecError(f"{path}: unexpected tensor {name!r} (not in a {method} drafter of this config)")
                if shape != want[ours]:
                    raise DeepSpecError(f"{path}: tensor {name!r} has shape {list(shape)}, expected {list(want[ours])}")
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    raise DeepSpecError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a floating type")
                _check_finite(t, name, path)
                state[ours] = t.float()
    return state, row


def _check_finite(t: torch.Tensor, name: str, path: Path) -> None:
    """A source checkpoint's tensor holds no NaN or inf: refused before anything is
    written, naming the source file and tensor (a damaged download or a diverged run)."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        n = int((~torch.isfinite(t)).sum())
        raise DeepSpecError(f"{path}: tensor {name!r} has {n} non-finite value(s) (NaN or inf): the checkpoint is "
                            "damaged (download or copy it again); nothing was converted")


def damaged_conversion(out: Path) -> str | None:
    """Why the converted drafter at `out` cannot be used as it is (its weights missing,
    unreadable, or holding a NaN or inf, as one an older deepspec wrote from a damaged
    source could), or None. Read a tensor at a time."""
    from safetensors import SafetensorError, safe_open

    try:
        for path in sorted(set(tensor_files(out).values())):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        return f"{path.name}: {name} has non-finite values"
    except (DeepSpecError, SafetensorError, OSError) as e:
        return first_line(e)
    return None


def save_model_atomic(model, out: Path, overwrite: bool) -> None:
    """save_pretrained into a temporary directory beside `out`, then rename."""
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(str(tmp))


# ----------------------------------------------------------------------------------------------
# conversion


def convert_reference_checkpoint(src, target, out, *, overwrite: bool = False) -> Path:
    """Convert the reference Eagle3/DFlash/DSpark checkpoint in directory `src` into
    a deepspec drafter for `target`, saved (float32, like trained drafters) at `out`.
    Everything is validated before anything is written; `out` appears only
    complete (written to a temporary directory beside it, then renamed)."""
    from ..drafters import CLASSES, draft_config

    src, out = Path(src), Path(out)
    check_out_apart(src, out)
    check_overwrite(out, overwrite)  # before the work: only a deepspec output may be replaced
    ref = read_reference_config(src)
    where = str(src / "config.json")
    method, drafter_cfg = _method(ref)
    drafter_cfg["layer_arch"] = reference_layer_arch(ref, target)  # Qwen3 layers over a Llama target, e.g.
    config = draft_config(method, target, drafter_cfg, ref["target_layer_ids"])
    check_reference_target(ref, target, where, config)
    # commit: the hub commit of a checkpoint from the hub cache (its snapshot directory), else None
    # or the commit a fetched snapshot recorded (deepspec/fetch.py: its files are links, not the cache's)
    fetched = read_record(src / SOURCE_FILE) or {}
    config.deepspec_source = {"checkpoint": str(src.resolve()),
                              "commit": snapshot_commit(src.resolve()) or fetched.get("commit"),
                              "architecture": ref["architectures"][0], "mask_token_id": ref.get("mask_token_id")}
    model = CLASSES[method](config).float()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in NOT_IN_CHECKPOINT}
    overwritten = method != "eagle3" and bool(ref.get(MASK_ROW_FIELD))
    state, row = _read_tensors(src, want, target, method, int(ref["mask_token_id"]) if overwritten else None,
                               null_markov=method != "eagle3" and bool(ref.get(NULL_MARKOV_FIELD)))
    for name in want:  # Gemma4 layers without a stored output scale: the reference's init, ones
        if name.endswith(".layer_scalar") and name not in state:
            state[name] = torch.ones(want[name])
    missing = sorted(set(want) - set(state))
    if missing:
        raise DeepSpecError(f"{src}: tensor {to_reference(missing[0])!r} missing"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if "mask_embedding" in model.state_dict():
        if overwritten and row is None:
            raise DeepSpecError(f"{where}: {MASK_ROW_FIELD} is set but the checkpoint has no embed_tokens.weight")
        with torch.no_grad():
            mid = torch.tensor([int(ref["mask_token_id"])], device=target.embed_tokens.weight.device)
            emb = row * embed_scale(target) if overwritten else target.embed_tokens(mid)[0].float().cpu()
        state["mask_embedding"] = emb
        if overwritten:  # a learned mask embedding, not the target's row
            model.config.deepspec_mask_token_id = None
    state["d2t"] = torch.arange(model.d2t.numel())
    model.load_state_dict(state, strict=True)
    save_model_atomic(model, out, overwrite)
    log.info("converted %s (%s, %d tensors) -> %s", src, method, len(state), out)
    return out

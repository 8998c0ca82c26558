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

from ..errors import DeepSpecError
from ..files import atomic_dir, check_overwrite
from .common import EAGLE3_ARCH, refuse
from .convert import check_out_apart
from .deepspec_layout import check_vllm_gemma4_names, deepspec_layout
from .eagle3 import check_eagle3, eagle3_layout
from .sglang import SGLANG_SPS_FILE, SGLANG_STS_FILE, check_sglang, sglang_files, sglang_serve
from .speculators import speculators_layout

log = logging.getLogger(__name__)

FORMATS = ("deepspec", "eagle3", "speculators")
ENGINES = ("vllm", "sglang")


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
            check_sglang(cfg, sd)
            files = sglang_files(d, sts, sps)
            cfg["deepspec_serve_sglang"] = sglang_serve(d, files)
    elif fmt == "speculators":
        cfg, sd = speculators_layout(d, target, mask_token_id, verifier)
    else:
        cfg, sd = eagle3_layout(d, target)
        if engine == "sglang" and cfg["architectures"] != [EAGLE3_ARCH["llama"]]:
            refuse("as eagle3 for SGLang", "SGLang's EAGLE-3 draft class is LlamaForCausalLMEagle3 (Llama layer) only")
        check_eagle3(cfg, sd)
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
    from ..vllm_env import VLLM_VERSION, check_vllm_version, installed_vllm_version, vllm_python

    try:
        py = vllm_python()
    except DeepSpecError:
        return {"vllm_tested": VLLM_VERSION, "vllm_found": None}
    return {"vllm_tested": VLLM_VERSION, "vllm_found": check_vllm_version(installed_vllm_version(py), py)}


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
    from ..paths import RunPaths
    from ..targets.loading import target_from_config
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

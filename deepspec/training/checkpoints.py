"""Training checkpoints (the train rule): `<out>/checkpoints/step_N/` with the model
(save_pretrained), optimiser, scheduler, trainer state, the log so far and
every process's RNG states (python, numpy, torch, CUDA, the anchor
generator), plus an atomically written `latest` pointer. Resuming restores all
of it, so a killed run continues exactly (tests/test_train.py).

A checkpoint records the training fingerprint (every setting that changes the
result, the data's fingerprint and FORMAT_VERSION), the sha256 of each of
its files and why it was written (`kind`: "regular" at train.checkpoint_every
and the end, "time" after train.checkpoint_minutes, "sigterm" before a stop).
After each new checkpoint `prune_checkpoints` deletes the older "time" and
"sigterm" ones (they exist only to resume, and the new one resumes further)
and all but the newest train.keep_checkpoints regular ones; it deletes only
the files a checkpoint's trainer state lists as its own. Resuming takes the newest intact checkpoint with the current
fingerprint: a damaged one is skipped (and said so), one made with other
settings is never resumed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from ..errors import DeepSpecError, first_line
from ..files import (
    OUTPUT_MARKER,
    file_lock,
    read_json,
    removed_on_failure,
    replace_dir,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)
from .state import TrainRun

log = logging.getLogger(__name__)

LOG_NAME = "train_log.csv"
CKPT_DIR = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
LOCK = ".train.lock"
FORMAT_VERSION = 2  # of checkpoints and of the training code's results; part of every fingerprint


def training_fingerprint(*parts) -> str:
    """sha256 (16 hex digits) of the JSON of `parts` and FORMAT_VERSION."""
    blob = json.dumps([FORMAT_VERSION, *parts], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def training_lock(out: Path, enabled: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on the output directory while training: a second
    trainer of the same directory stops with one line instead of interleaving.
    Where the filesystem has no flock (Lustre mounted without it), training runs
    without the lock, with a warning (`files.file_lock`)."""
    if not enabled:
        yield
        return
    with file_lock(out / LOCK, busy=f"another training run is writing {out}",
                   unlocked=f"training without the lock that keeps a second trainer of {out} out"):
        yield


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


def checkpoints_newest_first(out_dir: str | os.PathLike) -> list[Path]:
    root = Path(out_dir) / CKPT_DIR
    steps = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: -int(p.name[5:]))


def check_checkpoint(ckpt: Path) -> dict:
    """The trainer state of an intact checkpoint; a one-line DeepSpecError
    naming what is missing or damaged otherwise."""
    st = read_json(ckpt / TRAINER_STATE, f"{ckpt}: {TRAINER_STATE} missing (incomplete checkpoint)")
    if not isinstance(st, dict) or st.get("format_version") != FORMAT_VERSION or "files" not in st:
        raise DeepSpecError(f"{ckpt}: written by another version of deepspec (format {st.get('format_version')!r})")
    for name, digest in st["files"].items():
        if not (ckpt / name).exists():
            raise DeepSpecError(f"{ckpt / name} is missing")
        if sha256_file(ckpt / name) != digest:
            raise DeepSpecError(f"{ckpt / name} is damaged (sha256 mismatch)")
    return st


def find_resumable(out_dir: str | os.PathLike, fingerprint: str) -> tuple[Optional[Path], Optional[dict], str]:
    """(checkpoint, its state, "") for the newest intact checkpoint; damaged ones
    are skipped with a warning. (None, None, why) when there is none to resume:
    why is "changed" when the newest intact one was made with other settings or
    data, "damaged" when none is intact, "" when there are none."""
    why = ""
    for ckpt in checkpoints_newest_first(out_dir):
        try:
            st = check_checkpoint(ckpt)
        except DeepSpecError as e:
            log.warning("%s: falling back to the previous checkpoint", e)
            why = "damaged"
            continue
        if st.get("fingerprint") != fingerprint:
            return None, None, "changed"
        return ckpt, st, ""
    return None, None, why


def load_model_weights(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Load a `save_pretrained` directory's safetensors into `model` in place:
    every trainable parameter must be present, every stored tensor the model has
    must have its shape, and every value must be finite; each a one-line
    DeepSpecError naming the checkpoint file and the tensor (not torch's
    multi-line load_state_dict report)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DeepSpecError(f"{index}: malformed index (no weight_map)") from None
    state, where = {}, {}
    for name in files:
        try:
            part = load_file(str(directory / name))
        except (SafetensorError, OSError) as e:
            msg = first_line(e)
            raise DeepSpecError(f"{directory / name}: cannot read the checkpoint's weights ({msg})") from None
        state.update(part)
        where.update(dict.fromkeys(part, directory / name))
    have = model.state_dict()
    for k, t in state.items():
        if k in have and tuple(t.shape) != tuple(have[k].shape):
            raise DeepSpecError(f"{where[k]}: {k} is {list(t.shape)}, but the drafter being trained has "
                                f"{list(have[k].shape)}: the checkpoint was written for another drafter")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DeepSpecError(f"{where[k]}: {k} has {int((~torch.isfinite(t)).sum())} non-finite value(s) (NaN or "
                                f"inf): a diverged or damaged checkpoint is not resumed (remove {directory} to resume "
                                "from an earlier one, or start afresh)")
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    lost = sorted(n for n, p in model.named_parameters() if p.requires_grad and n in missing)
    if lost:
        raise DeepSpecError(f"checkpoint {directory} lacks trainable weights: {', '.join(lost[:5])}")


CHECKPOINT_KINDS = ("regular", "time", "sigterm")


def save_checkpoint(run: TrainRun, step: int, elapsed: float, kind: str = "regular") -> None:
    """<out>/checkpoints/step_N/ of `run` after update `step` (built under a
    temporary name, then renamed) and the `latest` pointer, written atomically;
    the trainer state (written last) holds the fingerprint, every file's
    sha256 and `kind` (CHECKPOINT_KINDS). Older checkpoints are then pruned
    (`prune_checkpoints`). elapsed: seconds trained so far."""
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"checkpoint kind {kind!r}")
    acc, root = run.acc, run.out / CKPT_DIR
    final, tmp = root / f"step_{step}", root / f".step_{step}.partial"
    # a failure (disk full: an OSError naming the checkpoint) leaves no .partial behind
    with removed_on_failure(tmp if acc.is_main_process else None, final):
        _write_checkpoint(run, step, elapsed, tmp, final, kind)
    acc.wait_for_everyone()


def _write_checkpoint(run: TrainRun, step: int, elapsed: float, tmp: Path, final: Path, kind: str) -> None:
    acc, model, opt, sched, out = run.acc, run.model, run.opt, run.sched, run.out
    if acc.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save(rng_state(run.gen), tmp / f"rng_{acc.process_index}.pt")
    if hasattr(opt, "consolidate_state_dict"):  # a sharded optimizer: its whole state on process 0
        opt.consolidate_state_dict(to=0)
    if acc.is_main_process:
        model.save_pretrained(str(tmp))
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        if (out / LOG_NAME).exists():
            shutil.copyfile(out / LOG_NAME, tmp / LOG_NAME)
    acc.wait_for_everyone()
    if acc.is_main_process:
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_json_atomic(tmp / TRAINER_STATE, {
            "format_version": FORMAT_VERSION, "fingerprint": run.fingerprint, "step": step, "total_steps": run.total,
            "num_samples": len(run.dataset), "world_size": acc.num_processes, "global_batch": run.settings.global_batch,
            "seed": run.settings.seed, "elapsed_s": elapsed, "kind": kind, "files": files,
        })
    acc.wait_for_everyone()
    if acc.is_main_process:
        replace_dir(tmp, final)  # not atomic_dir: every process writes into tmp between barriers
        write_text_atomic(final.parent / LATEST, final.name + "\n")
        prune_checkpoints(final.parent, run.settings.keep_checkpoints, newest=final)
        log.info("checkpoint %s", final)


def _own_checkpoint(ckpt: Path) -> Optional[dict]:
    """The trainer state of a checkpoint directory this code wrote (a readable
    trainer_state.json of this format with its file list), else None."""
    try:
        st = json.loads((ckpt / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(st, dict) and st.get("format_version") == FORMAT_VERSION and isinstance(st.get("files"), dict)
    return st if ok else None


def checkpoints_to_prune(states: list[tuple[Path, dict]], keep: Optional[int], newest: Path) -> list[Path]:
    """Of our checkpoints (directory, trainer state), newest first, those to
    delete once `newest` is written: every older "time" / "sigterm" one, and
    the regular ones (checkpoints without a kind count as regular) beyond the
    newest `keep` (None keeps them all). `newest` itself is never deleted."""
    drop, regular = [], 0
    for ckpt, st in states:
        if ckpt == newest:
            regular += st.get("kind", "regular") == "regular"
            continue
        if st.get("kind", "regular") != "regular":
            drop.append(ckpt)
            continue
        regular += 1
        if keep is not None and regular > int(keep):
            drop.append(ckpt)
    return drop


def prune_checkpoints(root: Path, keep: Optional[int], newest: Path) -> list[Path]:
    """Delete the checkpoints `checkpoints_to_prune` names under `root` (only
    the files each one's trainer state lists, then the trainer state and the
    output marker, then the directory if nothing else is in it: files we did
    not write stay). Returns
    the pruned directories."""
    states = [(c, st) for c in checkpoints_newest_first(root.parent) if (st := _own_checkpoint(c)) is not None]
    pruned = checkpoints_to_prune(states, keep, Path(newest))
    by_dir = dict(states)
    for ckpt in pruned:
        for name in by_dir[ckpt]["files"]:
            if "/" not in name and name not in ("", ".", ".."):
                (ckpt / name).unlink(missing_ok=True)
        (ckpt / TRAINER_STATE).unlink(missing_ok=True)
        (ckpt / OUTPUT_MARKER).unlink(missing_ok=True)  # replace_dir's mark of our directory
        try:
            ckpt.rmdir()
        except OSError:
            log.warning("%s: pruned, but it holds files that are not the checkpoint's: left in place", ckpt)
        log.info("pruned checkpoint %s (%s)", ckpt, by_dir[ckpt].get("kind", "regular"))
    return pruned


def resume_checkpoint(ckpt: Path, st: dict, run: TrainRun) -> tuple[int, float]:
    """Restore `run`'s weights, optimiser, scheduler, this process's RNG states
    and the log from an intact checkpoint (`check_checkpoint`'s state st);
    return (step, elapsed seconds before the interruption)."""
    model, opt, sched, out = run.model, run.opt, run.sched, run.out
    rank, main = run.acc.process_index, run.acc.is_main_process
    load_model_weights(model, ckpt)
    dev = next(model.parameters()).device
    opt.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=dev, weights_only=False))
    sched.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    rng = ckpt / f"rng_{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False), run.gen)
    else:
        log.warning("%s missing (world size was %d): RNG states of process %d are not restored",
                    rng.name, st["world_size"], rank)
    if main:
        if (ckpt / LOG_NAME).exists():
            shutil.copyfile(ckpt / LOG_NAME, out / LOG_NAME)
        else:
            (out / LOG_NAME).unlink(missing_ok=True)
    return int(st["step"]), float(st.get("elapsed_s", 0.0))

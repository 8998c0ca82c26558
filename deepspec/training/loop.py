"""The train rule (workflow/rules/train.smk): one generic, resumable loop from a
CPU laptop to a multi-GPU node.

The loop knows nothing about drafters; its arithmetic is
`deepspec.training.recipe`. It takes a model (a ``PreTrainedModel`` whose
frozen parts have ``requires_grad=False``), a map-style dataset of samples, a ``collate_fn`` and ``step_fn(model, batch, generator, log_step) -> (loss,
metrics)``, and implements the paper's recipe (paper Sec. 4.1; DeepSpec's deepspec/trainer/base_trainer.py):

* AdamW (lr 6e-4, weight decay 0) over the trainable parameters only, linear
  warmup over ``ceil(warmup_ratio * total)`` updates then cosine to 0, gradient
  clipping at 1.0;
* a global batch of ``train.global_batch`` sequences per update, split over
  processes and into micro batches of ``train.micro_batch`` with gradient
  accumulation; steps per epoch = max(1, floor(N / global_batch)), total steps
  = ceil(epochs * steps per epoch) capped by ``train.max_steps``;
* HF accelerate for launch, device and mixed precision (bf16 autocast on GPU
  with fp32 master weights, plain fp32 on CPU). Gradients are averaged across
  processes once per update with an all-reduce: the same arithmetic as DDP
  under ``no_sync``, but the model is not wrapped, so ``step_fn`` may call any
  method of the drafter (not only ``forward``);
* a deterministic data order: epoch ``e`` visits ``randperm(N)`` drawn from a
  generator seeded with ``(train.seed, e)``; step ``s`` takes the slice
  ``[s*G, (s+1)*G)`` of its epoch's order, so the sampler position is the step
  number. The seed is ``train.seed`` for every method (the reference uses 0 for
  Eagle3 and 42 for DFlash/DSpark; one seed keeps the comparison clean);
* checkpoints every ``train.checkpoint_every`` steps, every
  ``train.checkpoint_minutes`` of training (when set; each deleted once a newer
  checkpoint is written) and at the end (the newest ``train.keep_checkpoints``
  of these are kept) under
  ``<out>/checkpoints/step_N/`` (``save_pretrained`` model, optimiser,
  scheduler, trainer state, the log so far, and per-process RNG states:
  python, numpy, torch, CUDA and the anchor generator handed to ``step_fn``),
  plus a ``latest`` pointer written atomically (`deepspec.training.checkpoints`).
  Resuming restores all of it, so
  a killed run ends with bit-identical weights to an uninterrupted one.
  SIGTERM (SLURM's warning ahead of the time limit, the slurm profile) makes
  every process finish its step, write a checkpoint and stop with one line
  (`TrainingStopped`); the rerun continues from there;
* ``<out>/train_log.csv`` (one row every ``train.log_every`` steps, flushed),
  the same rows as TensorBoard scalars under ``<out>/tensorboard/`` (accelerate's
  tracker, main process; `deepspec.training.train_log`) and a tqdm bar; the
  final drafter is ``save_pretrained``'ed into ``<out>/`` with ``config.json``
  moved in last, marking completion.

``python -m deepspec train`` (`deepspec.training.run`) wires in the target, the
dataset and the drafter.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from ..config import EXECUTION_KEYS
from ..errors import DeepSpecError
from ..files import atomic_dir, write_json_atomic
from ..provenance import code_commit
from ..runtime import resolve_precision
from ..settings import Train
from .checkpoints import (
    CKPT_DIR,
    LOG_NAME,
    find_resumable,
    resume_checkpoint,
    save_checkpoint,
    training_fingerprint,
    training_lock,
)
from .recipe import (
    StepSampler,
    accumulation_steps,
    make_optimizer,
    micro_seed,
    plan_steps,
    split_batch,
)
from .state import StepFn, TrainRun
from .stopping import StopOnSigterm, TrainingStopped, any_process, warn_if_sigterm_checkpoint_may_be_cut
from .train_log import TB_DIR, TrainLog, finish_tensorboard, start_tensorboard, tensorboard_available

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- loop


@dataclass
class TrainResult:
    out_dir: Path
    steps: int  # total optimiser steps of the run (== the final step)
    steps_this_process: int  # steps run by this invocation (after a resume: the remainder)
    elapsed_s: float  # training wall time of this invocation
    positions_per_s: float  # predicted positions per second, all processes
    sequences_per_s: float
    counters: Optional[dict] = None  # train(counters=...) summed over processes, this invocation


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


POSITION_KEYS = ("num_positions", "n_positions")


def _count_positions(metrics: dict, batch: dict) -> float:
    """Predicted positions of a micro batch: the step function's
    `n_positions` (or `num_positions`) when it reports one, else the
    loss-mask (assistant) tokens."""
    for key in POSITION_KEYS:
        if key in metrics:
            return float(metrics[key])
    if torch.is_tensor(batch.get("loss_mask")):
        return float(batch["loss_mask"].sum())
    return 0.0


def _use_cpu(device: str) -> bool:
    return not str(device).startswith("cuda") or not torch.cuda.is_available()


def make_accelerator(device: str, accum: int, precision: str = "auto", log_dir: Optional[Path] = None):
    """An Accelerator on `device` ('cpu' forces CPU) with bf16 autocast where
    train.precision resolves to bfloat16 (`runtime.resolve_precision`: auto takes
    it on a GPU with bf16 and on a CPU with AMX-BF16 or AVX512-BF16); master weights, optimiser
    state and the losses' softmax / L1 terms stay fp32 either way. log_dir: the
    project directory of accelerate's TensorBoard tracker (`train_log.start_tensorboard`);
    without the tensorboard package, one warning and no tracker."""
    from accelerate import Accelerator

    cpu = _use_cpu(device)
    bf16 = resolve_precision(precision, "cpu" if cpu else "cuda", stage="train") == "bfloat16"
    tb = log_dir is not None and tensorboard_available()
    _release_other_precision("bf16" if bf16 else "no")
    acc = Accelerator(cpu=cpu, mixed_precision="bf16" if bf16 else "no", gradient_accumulation_steps=accum,
                      **({"log_with": "tensorboard", "project_dir": str(log_dir)} if tb else {}))
    if log_dir is not None and not tb and acc.is_main_process:
        log.warning("no TensorBoard logging: the tensorboard package is not installed (pip install tensorboard); "
                    "train_log.csv has the same rows")
    if acc.gradient_accumulation_steps != accum:
        raise DeepSpecError(
            f"gradient accumulation is {acc.gradient_accumulation_steps}, expected {accum} "
            "(unset ACCELERATE_GRADIENT_ACCUMULATION_STEPS)"
        )
    return acc


def _release_other_precision(mixed: str) -> None:
    """accelerate keeps one AcceleratorState per process and refuses a second
    Accelerator with another mixed precision; a process that trains twice (a
    benchmark's sweep, the tests) with different train.precision starts the
    second from a fresh state (the distributed PartialState is kept)."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state.get("_mixed_precision") not in (None, mixed):
        AcceleratorState._reset_state(reset_partial_state=False)


def process_device(device: str) -> torch.device:
    """The device this process trains on (its own GPU under accelerate launch)."""
    from accelerate import PartialState

    return PartialState(cpu=_use_cpu(device)).device


def train(
    model: torch.nn.Module,
    dataset,
    step_fn: StepFn,
    train: Train | Mapping,
    out_dir: str | os.PathLike,
    *,
    collate_fn: Callable[[list], dict],
    resume: Optional[bool] = None,
    device: str = "cpu",
    fingerprint: Optional[str] = None,
    counters: Optional[Callable[[], dict]] = None,
) -> TrainResult:
    """Train `model` on `dataset` with the recipe of the module docstring.

    fingerprint: everything the result depends on (settings, data, code
    version; default: the train settings and the dataset size). Only a
    checkpoint with the same fingerprint is resumed. resume: None resumes from
    the newest intact checkpoint of this fingerprint and otherwise starts
    afresh (saying why), True requires one, False starts afresh (deleting old
    checkpoints). The output directory is locked while training. counters:
    a process's integer counts (e.g. `OnlineFeatures.counters`), summed over
    processes into the result and train_summary.json.
    """
    from accelerate import PartialState

    out = Path(out_dir)
    settings = Train.view(train)
    state = PartialState(cpu=_use_cpu(device))
    with training_lock(out, enabled=state.is_main_process):
        return _train_locked(model, dataset, step_fn, settings, out, collate_fn, resume, device,
                             fingerprint or training_fingerprint(_result_settings(settings), len(dataset)), counters)


def _result_settings(settings: Train) -> dict:
    """The train settings that change the result (not checkpoint cadence, GPU count)."""
    return {k: v for k, v in dataclasses.asdict(settings).items() if f"train.{k}" not in EXECUTION_KEYS}


def _train_locked(model, dataset, step_fn, settings: Train, out, collate_fn, resume, device, fingerprint,
                  counters=None) -> TrainResult:
    from accelerate import PartialState

    state = PartialState(cpu=_use_cpu(device))
    world = state.num_processes
    if state.is_main_process:
        warn_if_sigterm_checkpoint_may_be_cut(world)
    acc = make_accelerator(device, accumulation_steps(settings, world), settings.precision, log_dir=out / TB_DIR)
    n = len(dataset)
    per_epoch, total = plan_steps(n, settings)
    g = settings.global_batch
    if n < g:
        log.warning("dataset has %d samples < global_batch %d: batches repeat samples", n, g)
    params = _trainable_params(model, acc)
    opt, sched = make_optimizer(params, settings, total, shard=settings.shard_optimizer and world > 1)
    gen = torch.Generator(device=acc.device)  # reseeded for every micro batch (micro_seed)
    run = TrainRun(acc, model, params, opt, sched, gen, dataset, collate_fn, step_fn, settings, out,
                   StepSampler(n, g, settings.seed), per_epoch, total, fingerprint)
    start, elapsed_before = _start_or_resume(run, resume)
    log.info(
        "training: %d samples, %d steps/epoch, %d steps (epochs %s, max_steps %s), global batch %d = "
        "%d processes x %d micro x %d accumulation, %.2fM trainable / %.2fM frozen params, %s, %s",
        n, per_epoch, total, settings.epochs, settings.max_steps, g, world,
        settings.micro_batch, acc.gradient_accumulation_steps, sum(p.numel() for p in params) / 1e6,
        sum(p.numel() for p in model.parameters() if not p.requires_grad) / 1e6, acc.device, acc.mixed_precision,
    )
    t_run = time.perf_counter()
    positions_run = _run_steps(run, start, elapsed_before, t_run)
    elapsed = time.perf_counter() - t_run
    acc.wait_for_everyone()

    ran = total - start
    positions_all = float(acc.reduce(torch.tensor(positions_run, device=acc.device), "sum")) if world > 1 else positions_run
    result = TrainResult(out, total, ran, elapsed, positions_all / max(elapsed, 1e-9), ran * g / max(elapsed, 1e-9),
                         _summed(acc, counters() if counters else {}, world))
    if acc.is_main_process:
        precision = {"device": acc.device.type, "processes": world, "mixed_precision": acc.mixed_precision,
                     "param_dtype": str(params[0].dtype).replace("torch.", "")}
        _save_final(model, out, result, settings, precision)
    acc.wait_for_everyone()
    (log.info if acc.is_main_process else log.debug)(
        "trained %d steps in %.1f s: %.1f predicted positions/s, %.2f sequences/s; drafter in %s",
        ran, elapsed, result.positions_per_s, result.sequences_per_s, out,
    )
    return result


def _summed(acc, counts: dict, world: int) -> dict:
    """Integer counters summed over processes (same keys on every process)."""
    if world > 1 and counts:
        vec = acc.reduce(torch.tensor(list(counts.values()), dtype=torch.float64, device=acc.device), "sum")
        counts = dict(zip(counts, (int(x) for x in vec.tolist())))
    if counts:
        log.info("counts of this run: %s", ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    return counts


def _trainable_params(model: torch.nn.Module, acc) -> list:
    """The model on this process's device in train mode; its trainable
    parameters, identical on every process."""
    model.to(acc.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise DeepSpecError("the model has no trainable parameters")
    if acc.num_processes > 1:
        for p in params:
            torch.distributed.broadcast(p.data, src=0)
    return params


def _start_or_resume(run: TrainRun, resume: Optional[bool]) -> tuple[int, float]:
    """(first step, seconds trained before): resume from the newest intact
    checkpoint with this run's fingerprint, or start afresh (resume False
    deletes old checkpoints; True requires a checkpoint to resume)."""
    acc, out = run.acc, run.out
    ckpt_root = out / CKPT_DIR
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").unlink(missing_ok=True)  # present only once training completed
    ckpt, st, why = find_resumable(out, run.fingerprint) if resume is not False else (None, None, "")
    if ckpt is None and resume:
        reason = {"changed": "the training settings or data changed since it was written",
                  "damaged": "every checkpoint is damaged"}.get(why, "there is none")
        raise DeepSpecError(f"--resume: no checkpoint to resume under {ckpt_root}: {reason}")
    if ckpt is None and why:
        log.warning("%s: %s; starting afresh", ckpt_root, "the training settings or data changed" if why == "changed"
                    else "no intact checkpoint")
    acc.wait_for_everyone()
    if ckpt is None and acc.is_main_process and ckpt_root.exists():
        shutil.rmtree(ckpt_root)
    acc.wait_for_everyone()
    start, elapsed_before = 0, 0.0
    if ckpt is not None:
        start, elapsed_before = resume_checkpoint(ckpt, st, run)
        log.info("resumed from %s at step %d/%d", ckpt, start, run.total)
    elif acc.is_main_process:
        (out / LOG_NAME).unlink(missing_ok=True)
        shutil.rmtree(out / TB_DIR, ignore_errors=True)  # its event files start afresh with the log
    acc.wait_for_everyone()
    return start, elapsed_before


def _run_steps(run: TrainRun, start: int, elapsed_before: float, t_run: float) -> float:
    """Optimiser steps start..total with logging (train_log.csv and TensorBoard,
    the run named after the output directory) and checkpoints; returns the
    positions this process predicted."""
    from tqdm.auto import tqdm

    if start < run.total:
        start_tensorboard(run.acc, run.out.name, start)
    train_log = TrainLog(run.out / LOG_NAME, enabled=run.acc.is_main_process, acc=run.acc)
    bar = tqdm(total=run.total, initial=start, disable=not run.acc.is_main_process, desc="train", dynamic_ncols=True)
    try:
        with StopOnSigterm() as stop:
            positions_run = _steps(run, start, elapsed_before, t_run, train_log, bar, stop)
    finally:
        finish_tensorboard(run.acc)
    bar.close()
    return positions_run


def _steps(run: TrainRun, start, elapsed_before, t_run, train_log, bar, stop) -> float:
    acc, t = run.acc, run.settings
    every_s = (t.checkpoint_minutes or 0) * 60
    last_ckpt = time.monotonic()
    positions_run = 0.0
    for step in range(start, run.total):
        t0 = time.perf_counter()
        done = step + 1
        log_step = done % t.log_every == 0 or done == run.total or done == 1
        sums, positions = _accumulate(run, step, log_step)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, t.grad_clip))
        lr = run.sched.get_last_lr()[0]
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad(set_to_none=True)
        positions_run += positions
        if log_step:
            row = _log_row(run, done, lr, sums, grad_norm, positions, time.perf_counter() - t0,
                           elapsed_before + time.perf_counter() - t_run)
            train_log.write(row)
            bar.set_postfix({k: f"{row[k]:.4g}" for k in ("loss", "tau_expected") if k in row}, refresh=False)
        bar.update(1)
        timed, stopping = any_process(acc, run.world, every_s > 0 and time.monotonic() - last_ckpt >= every_s,
                                       stop.requested)
        regular = done % t.checkpoint_every == 0 or done == run.total
        if regular or timed or stopping:
            kind = "regular" if regular else "sigterm" if stopping else "time"
            save_checkpoint(run, done, elapsed_before + time.perf_counter() - t_run, kind)
            last_ckpt = time.monotonic()
        if stopping and done < run.total:
            raise TrainingStopped(f"stopped by SIGTERM after step {done}/{run.total}: checkpoint "
                                  f"{run.out / CKPT_DIR / f'step_{done}'} written; rerun to resume")
    return positions_run


def _accumulate(run: TrainRun, step: int, log_step: bool) -> tuple[dict, float]:
    """Forward and backward of this process's micro batches of update `step`,
    gradients averaged over processes. Returns ({metric: [sum, micro batches
    reporting it]}, predicted positions)."""
    acc = run.acc
    sums: dict[str, list] = {}
    positions = 0.0
    micro = run.settings.micro_batch
    for k, idx in split_batch(run.sampler.indices(step), acc.process_index, run.world, micro):
        batch = _to_device(run.collate_fn([run.dataset[i] for i in idx]), acc.device)
        run.gen.manual_seed(micro_seed(run.settings.seed, step, k))
        with acc.autocast():
            loss, metrics = run.step_fn(run.model, batch, run.gen, log_step=log_step)
        if not torch.isfinite(loss):
            raise DeepSpecError(f"non-finite training loss {loss.item()} at step {step + 1}")
        acc.backward(loss)  # divides by the accumulation steps
        positions += _count_positions(metrics, batch)
        for k, v in {"loss": loss.item(), **metrics}.items():
            acc_k = sums.setdefault(k, [0.0, 0])
            acc_k[0] += float(v)
            acc_k[1] += 1
    if run.world > 1:
        for p in run.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(run.world)
    return sums, positions


def _log_row(run: TrainRun, done: int, lr: float, sums: dict, grad_norm: float, positions: float, step_s: float,
             elapsed: float) -> dict:
    """One train_log row: each metric is its mean over the micro batches (of all
    processes) that reported it; positions are summed over processes."""
    acc, world, g = run.acc, run.world, run.settings.global_batch
    keys = list(sums)
    if world > 1:  # the union of the processes' metric names, in first-seen order
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, keys)
        keys = list(dict.fromkeys(k for ks in gathered for k in ks))
    vec = torch.tensor([x for k in keys for x in sums.get(k, (0.0, 0))] + [positions], dtype=torch.float64)
    if world > 1:
        vec = acc.reduce(vec.to(acc.device), "sum").cpu()
    metrics = {k: float(vec[2 * i] / vec[2 * i + 1]) if vec[2 * i + 1] > 0 else float("nan")
               for i, k in enumerate(keys)}
    positions = float(vec[-1])
    row = {"step": done, "epoch": done / run.per_epoch, "lr": lr, "loss": metrics.get("loss", float("nan"))}
    row.update({k: v for k, v in metrics.items() if k != "loss"})
    row.update(grad_norm=grad_norm, positions_per_s=positions / step_s, sequences_per_s=g / step_s, elapsed_s=elapsed)
    return row


def _save_final(model, out: Path, result: TrainResult, settings: Train, precision: Optional[dict] = None) -> None:
    """save_pretrained into a temporary directory, move the files into <out>,
    config.json last. train_summary.json: the run's counts and rates, the
    train settings and `precision` (device type, processes, accelerate's
    mixed precision, the trainable parameters' dtype) and the code's commit
    (`provenance.code_commit`): the provenance record's."""
    with atomic_dir(out, merge=True) as tmp:
        model.save_pretrained(str(tmp))
        write_json_atomic(tmp / "train_summary.json", {
            "steps": result.steps, "steps_this_process": result.steps_this_process, "elapsed_s": result.elapsed_s,
            "positions_per_s": result.positions_per_s, "sequences_per_s": result.sequences_per_s,
            "train": dataclasses.asdict(settings),
            "precision": precision, "code": code_commit(), **(result.counters or {}),
        })

"""The paper's training recipe as arithmetic (paper Sec. 4.1), for the train
rule's loop (`deepspec.training.loop`): steps per epoch and in total, the
warmup + cosine learning rate, AdamW, the global batch split over processes and
micro batches, the deterministic data order, the per-micro-batch seeds that
make N processes follow the same trajectory as one, and the memory a step holds
(`training_memory`, also the plan's). torch is imported where it
is used, so that the plan-time checks (planning/preflight.py) can use the
arithmetic without it.
"""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Mapping, Sequence

from ..errors import DeepSpecError
from ..settings import Settings, Train

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------- schedule


def plan_steps(num_samples: int, train: Train | Mapping) -> tuple[int, int]:
    """(steps per epoch, total optimiser steps) for a dataset of `num_samples`
    (train.max_steps resolved for the method: `methods.resolve_method`)."""
    t = Train.view(train)
    if num_samples < 1:
        raise DeepSpecError("training dataset is empty")
    per_epoch = max(1, num_samples // t.global_batch)
    total = max(1, math.ceil(t.epochs * per_epoch - 1e-9))
    if t.max_steps:
        total = min(total, int(t.max_steps))
    return per_epoch, total


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Number of linear-warmup updates: ceil(ratio * total) (as HF Trainer)."""
    return math.ceil(warmup_ratio * total_steps)


def lr_factor(step: int, total_steps: int, num_warmup: int) -> float:
    """Multiplier of the peak lr for update number `step` (0-based).

    Warmup: (step + 1) / num_warmup, reaching 1 at the last warmup update; then
    cosine from 1 at `num_warmup` down to 0 at `total_steps` (the update after
    the last one), so every update has a positive lr.
    """
    if step < num_warmup:
        return (step + 1) / num_warmup
    progress = (step - num_warmup) / max(1, total_steps - num_warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: Sequence[torch.nn.Parameter], train: Train | Mapping, total_steps: int,
                   shard: bool = False):
    """AdamW + LambdaLR(warmup, cosine to 0) over `params`.

    The fused AdamW kernel (one pass per tensor instead of the for-loop's
    several) where torch has it for these tensors' devices: the same update up to
    rounding (~1e-7), 7x faster on CPU, where the for-loop over DSpark's 12.6 M
    Markov-embedding parameters cost ~0.1 s a step (docs/RESULTS.md).

    shard (train.shard_optimizer, with more than one process): ZeroRedundancyOptimizer,
    each process keeping the AdamW moments of its share of the parameters only
    (8 bytes per trainable parameter / processes instead of 8) and updating that
    share, which it then broadcasts; the update of every parameter is the same
    AdamW step. Its state_dict needs `consolidate_state_dict` on every process first
    (deepspec.training.checkpoints) and is then an ordinary AdamW state."""
    import torch

    fused_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in fused_dtypes for p in params)
    train = Train.view(train)
    kw = dict(lr=float(train.lr), weight_decay=train.weight_decay, fused=fused or None)
    if shard:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(params, **kw)
    n_warm = warmup_steps(total_steps, train.warmup_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, n_warm))
    return opt, sched


# --------------------------------------------------------------------------- data order


class StepSampler:
    """Deterministic, resumable data order: `indices(step)` is the global batch
    of update `step` (0-based). The position is the step number itself.

    Epoch e's order is randperm(N) from a generator seeded with (seed, e); when
    N < global_batch, further permutations from the same generator are
    appended so that a step always has a full global batch.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        self.n, self.g, self.seed = int(num_samples), int(global_batch), int(seed)
        self.steps_per_epoch = max(1, self.n // self.g)
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            import torch

            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            reps = max(1, math.ceil(self.g / self.n))
            self._order = torch.cat([torch.randperm(self.n, generator=gen) for _ in range(reps)])
            self._epoch = epoch
        return self._order

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        return self._epoch_order(epoch)[k * self.g:(k + 1) * self.g].tolist()


def split_batch(indices: Sequence[int], rank: int, world: int, micro: int) -> list[tuple[int, list[int]]]:
    """This process's micro batches of a global batch (contiguous rank slices),
    each with its index among all the global batch's micro batches: the same
    micro batch has the same index whatever the number of processes."""
    per_rank = len(indices) // world
    mine = list(indices[rank * per_rank:(rank + 1) * per_rank])
    first = rank * per_rank // micro
    return [(first + k, mine[i:i + micro]) for k, i in enumerate(range(0, len(mine), micro))]


def micro_seed(seed: int, step: int, micro_index: int) -> int:
    """The seed of the generator handed to step_fn for one micro batch (the
    block drafters' anchors): a function of the update and the micro batch's
    place in the global batch only, so 1 or N processes draw the same anchors
    and a run resumed under another world size continues the same trajectory."""
    h = hashlib.sha256(f"{seed}:{step}:{micro_index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def accumulation_steps(train: Train | Mapping, world: int) -> int:
    t = Train.view(train)
    g, m = t.global_batch, t.micro_batch
    if g % (world * m):
        raise DeepSpecError(
            f"train.global_batch ({g}) must be a multiple of train.micro_batch ({m}) x processes ({world})"
        )
    return g // (world * m)


# --------------------------------------------------------------------------- memory


def training_memory(cfg: Settings | Mapping, target_params: int, params: dict, peak_activation_bytes: int) -> dict:
    """Bytes one training process holds on its GPU, by arithmetic: the frozen target
    in target.dtype, the drafter's own parameters in fp32, the trainable ones'
    fp32 gradients and AdamW's two fp32 moments (divided over the processes with
    train.shard_optimizer), and a micro batch's peak activations at max length. Not
    counted: online features, CUDA context, allocator slack, NCCL buffers."""
    import torch

    s = Settings.view(cfg)
    t = s.train
    procs = t.gpus * t.nodes if t.gpus else t.processes
    shards = procs if t.shard_optimizer and procs > 1 else 1
    dtype_bytes = torch.empty(0, dtype=getattr(torch, s.target.dtype)).element_size()
    parts = {"target_weights": target_params * dtype_bytes,
             "drafter_weights": 4 * (params["trainable"] + params["frozen_own"]),
             "gradients": 4 * params["trainable"],
             "adam_moments": -(-8 * params["trainable"] // shards),
             "activations": int(peak_activation_bytes)}
    return {**parts, "total": sum(parts.values()), "optimizer_shards": shards}


def data_order_bytes(num_samples: int, global_batch: int) -> int:
    """`StepSampler`'s memory: an epoch's order (ceil(global_batch / N)
    permutations of N int64) and one step's indices as a Python list (a pointer
    and an int object each)."""
    n, g = int(num_samples), int(global_batch)
    return 8 * max(1, math.ceil(g / max(n, 1))) * n + 40 * g

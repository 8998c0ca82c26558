"""Process-wide settings: the Hugging Face offline switches, and glibc's
allocator for CPU runs.

`hub_offline`: any of HF_HUB_OFFLINE, HF_DATASETS_OFFLINE and TRANSFORMERS_OFFLINE
set to 1 / true / yes / on (any case) means "do not touch the network", for
every download deepspec makes (prompt sources, the hub check of target facts):
one switch that the Hugging Face libraries read under different names.

`keep_large_allocations_on_heap`: glibc serves every allocation above its
largest mmap threshold (32 MB on 64-bit) with a fresh mmap and unmaps it on
free, so each such tensor is paid for again in page faults every time it is
made. A CPU training step makes several per micro batch: the [rows, 49k] p_t
temporaries and DSpark's dense [49k, 256] Markov-embedding gradient. With mmap
off, they come from the heap and freed memory is kept for reuse (given back to
the OS only when more than 1 GiB is free at the top). Measured on the CPU
default: a DSpark step spent ~15 % of its time in the kernel, and the setting
took 1.5 -> 1.1-1.2 s a step (docs/RESULTS.md). GPU runs leave glibc as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> bool:
    """Whether the environment asks for no network (see the module docstring)."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in OFFLINE_VARIABLES)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_MAX = -4
_applied = False


def keep_large_allocations_on_heap() -> bool:
    """Turn glibc's mmap for large allocations off in this process (see the
    module docstring). Returns whether the setting is in effect (Linux/glibc)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False
    return _applied


# ---------------------------------------------------------------- precision

PRECISIONS = ("auto", "float32", "bfloat16")


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_matmul_support(device: str = "cpu") -> tuple[bool, str]:
    """(whether `device` multiplies bf16 matrices natively, the reason in words).

    CUDA: torch.cuda.is_bf16_supported() (Ampere and newer). CPU: an instruction that
    multiplies bf16 in hardware, probed by torch (else read from /proc/cpuinfo's flags):
    the AMX-BF16 tile engine (Intel Sapphire Rapids and newer) or AVX512-BF16's
    dot-product instructions (e.g. AMD Zen 4). Every CPU stage measured faster in bf16
    on both: 1.3-2.8x with AMX, 1.3-2.0x with AVX512-BF16 alone (docs/PERFORMANCE.md).
    A CPU with neither (AVX2 only, or AVX-512 without BF16) runs bf16 matmuls emulated,
    measured at 0.4 GFLOP/s on an AVX2 machine of this kind against 84 in fp32, so fp32 there."""
    import torch

    if str(device).startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA GPU with bf16" if ok else "CUDA GPU without native bf16"
    cap = torch.backends.cpu.get_cpu_capability()
    for name, probe, flag in (("AMX-BF16", "_is_amx_tile_supported", "amx_bf16"),
                              ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16")):
        fn = getattr(torch.cpu, probe, None)
        if (bool(fn()) if fn is not None else flag in _cpu_flags()):
            return True, f"CPU with {name} ({cap})"
    return False, f"CPU without AMX-BF16 or AVX512-BF16 ({cap})"


def resolve_precision(setting: str, device: str = "cpu", *, stage: str = "") -> str:
    """The compute dtype a stage runs in: 'bfloat16' or 'float32'.

    setting: auto | float32 | bfloat16 (the stage's `precision` key). auto takes
    bf16 where the device multiplies bf16 matrices natively (`bf16_matmul_support`),
    else fp32 (every stage measured faster in bf16 there: docs/PERFORMANCE.md);
    an explicit value is taken as it is (bfloat16 on a CPU without AMX is slow, and
    said so in the log)."""
    import logging

    if setting not in PRECISIONS:
        raise ValueError(f"precision {setting!r}: expected one of {', '.join(PRECISIONS)}")
    ok, why = bf16_matmul_support(device)
    resolved = setting if setting != "auto" else ("bfloat16" if ok else "float32")
    log = logging.getLogger("deepspec")
    if setting == "bfloat16" and not ok:
        log.warning("%sprecision bfloat16 on a %s: bf16 matmuls are slow here", f"{stage}: " if stage else "", why)
    log.info("%sprecision %s (%s%s)", f"{stage}: " if stage else "", resolved, setting,
             f" -> {resolved}: {why}" if setting == "auto" else "")
    return resolved

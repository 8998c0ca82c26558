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

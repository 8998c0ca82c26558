"""What the DSpark paper publishes, for comparison in the report: its
benchmark and method names and Table 1 (paper p. 11, Sec. 4.1-4.2: accepted length
tau per round, bonus included (footnote 3), T = 1.0, block 7).
"""
from __future__ import annotations

BENCHMARK_ORDER = ["gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "alpaca", "arena-hard"]
BENCHMARK_LABEL = {
    "gsm8k": "GSM8K", "math500": "MATH500", "aime25": "AIME25", "mbpp": "MBPP", "humaneval": "HumanEval",
    "livecodebench": "LCB", "mt-bench": "MT-Bench", "alpaca": "Alpaca", "arena-hard": "Arena-Hard",
}
METHOD_ORDER = ["eagle3", "dflash", "dspark"]
METHOD_LABEL = {"eagle3": "Eagle3", "dflash": "DFlash", "dspark": "DSpark"}
# how the figures draw each method
METHOD_COLORS = {"dflash": "#1f77b4", "eagle3": "#2ca02c", "dspark": "#d62728"}
METHOD_MARKERS = {"dflash": "s", "eagle3": "^", "dspark": "o"}

_T1 = {
    ("Qwen3-4B", "eagle3"): [5.14, 4.62, 3.92, 3.69, 4.16, 3.77, 2.39, 2.26, 2.55],
    ("Qwen3-4B", "dflash"): [5.40, 4.85, 4.15, 4.40, 4.74, 4.18, 3.07, 2.96, 2.83],
    ("Qwen3-4B", "dspark"): [6.11, 5.70, 4.89, 5.13, 5.38, 4.86, 3.64, 3.54, 3.29],
    ("Qwen3-8B", "eagle3"): [5.30, 4.77, 3.91, 3.96, 4.33, 4.17, 2.66, 2.54, 2.54],
    ("Qwen3-8B", "dflash"): [5.33, 4.91, 4.07, 4.36, 4.64, 4.39, 3.11, 2.98, 2.81],
    ("Qwen3-8B", "dspark"): [6.17, 5.78, 5.01, 5.16, 5.52, 5.17, 3.72, 3.58, 3.21],
    ("Qwen3-14B", "eagle3"): [5.24, 4.60, 3.71, 3.81, 4.14, 4.01, 2.62, 2.47, 2.48],
    ("Qwen3-14B", "dflash"): [5.41, 4.84, 3.98, 4.44, 4.59, 4.33, 3.10, 2.94, 2.72],
    ("Qwen3-14B", "dspark"): [6.21, 5.74, 4.94, 5.26, 5.43, 5.02, 3.70, 3.58, 3.13],
    ("Gemma4-12B", "eagle3"): [5.87, 5.46, 4.83, 4.72, 5.37, 4.16, 3.19, 3.06, 2.72],
    ("Gemma4-12B", "dflash"): [5.45, 5.04, 4.22, 4.39, 4.95, 3.70, 2.98, 2.84, 2.59],
    ("Gemma4-12B", "dspark"): [6.05, 5.78, 5.12, 5.11, 5.64, 4.51, 3.49, 3.35, 2.92],
}
TABLE1 = {(t, m, b): v for (t, m), vals in _T1.items() for b, v in zip(BENCHMARK_ORDER, vals)}


def macro_gain(target: str, method: str, base: str) -> float:
    """The relative gain of `method` over `base` in Table 1's macro tau (the mean
    over the nine benchmarks) for `target`: DSpark on Qwen3-4B is +16.3 % over
    DFlash and +30.9 % over Eagle3."""
    def macro(m):
        return sum(_T1[(target, m)]) / len(_T1[(target, m)])
    return macro(method) / macro(base) - 1

# Figure 2 (paper p. 12): conditional acceptance per draft position 1..7,
# Qwen3-4B, averaged over each domain's benchmarks (read off the figure's
# vector paths; 1 + sum_k prod_{i<=k} c_i reproduces Table 1's domain means).
FIG2_TARGET = "Qwen3-4B"
FIG2 = {
    ("Math", "dflash"): [0.885, 0.827, 0.820, 0.834, 0.841, 0.839, 0.828],
    ("Math", "eagle3"): [0.811, 0.823, 0.838, 0.844, 0.851, 0.856, 0.850],
    ("Math", "dspark"): [0.905, 0.890, 0.888, 0.885, 0.887, 0.891, 0.882],
    ("Code", "dflash"): [0.865, 0.815, 0.797, 0.801, 0.810, 0.801, 0.777],
    ("Code", "eagle3"): [0.771, 0.774, 0.781, 0.791, 0.787, 0.794, 0.784],
    ("Code", "dspark"): [0.886, 0.872, 0.860, 0.861, 0.858, 0.859, 0.851],
    ("Chat", "dflash"): [0.718, 0.648, 0.638, 0.661, 0.682, 0.692, 0.688],
    ("Chat", "eagle3"): [0.534, 0.589, 0.642, 0.678, 0.709, 0.729, 0.733],
    ("Chat", "dspark"): [0.735, 0.738, 0.740, 0.744, 0.758, 0.766, 0.761],
}

"""The engine tier: tests that run a serving engine's own code on our exports:
vLLM (DEEPSPEC_VLLM_PYTHON) and SGLang (DEEPSPEC_SGLANG_PYTHON, test_sglang_*.py).

Each engine's tests are skipped unless its variable names a python in which the
engine imports (checked once per session, in a subprocess: the engines are never
imported into the test process, whose torch may differ). Such tests run the
engine-side code by path with that python, e.g.
deepspec/serving/engine_side/loadcheck.py.

    DEEPSPEC_VLLM_PYTHON=/path/to/vllm-venv/bin/python python -m pytest -q tests/engine
    DEEPSPEC_SGLANG_PYTHON=/path/to/sglang-venv/bin/python python -m pytest -q tests/engine
"""
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENGINES = {"vllm": "DEEPSPEC_VLLM_PYTHON", "sglang": "DEEPSPEC_SGLANG_PYTHON"}


@lru_cache(maxsize=None)
def _why_not(engine: str) -> str | None:
    """None when the engine's python imports it, else the reason to skip."""
    var = ENGINES[engine]
    py = os.environ.get(var)
    if not py:
        return f"{var} is not set (a python with {engine} installed)"
    try:
        r = subprocess.run([py, "-c", f"import {engine}"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{var}={py}: {e}"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"{var}={py} cannot import {engine}: {tail}"
    return None


def _engine(item) -> str:
    return "sglang" if Path(str(item.fspath)).name.startswith("test_sglang") else "vllm"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and (why := _why_not(_engine(item))):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if _why_not("vllm"):
        pytest.skip(_why_not("vllm"))
    return os.environ["DEEPSPEC_VLLM_PYTHON"]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    if _why_not("sglang"):
        pytest.skip(_why_not("sglang"))
    return os.environ["DEEPSPEC_SGLANG_PYTHON"]

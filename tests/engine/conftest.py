"""The engine tier: tests that run a serving engine's own code (vLLM) on our exports.

Skipped unless DEEPSPEC_VLLM_PYTHON names a python in which `import vllm` works
(checked once per session, in a subprocess: vLLM is never imported into the test
process, whose torch may differ). Such tests run the engine-side code by path with
that python, e.g. deepspec/serving/engine_side/loadcheck.py.

    DEEPSPEC_VLLM_PYTHON=/path/to/vllm-venv/bin/python python -m pytest -q tests/engine
"""
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def _why_not() -> str | None:
    """None when DEEPSPEC_VLLM_PYTHON imports vllm, else the reason to skip."""
    py = os.environ.get("DEEPSPEC_VLLM_PYTHON")
    if not py:
        return "DEEPSPEC_VLLM_PYTHON is not set (a python with vllm installed)"
    try:
        r = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"DEEPSPEC_VLLM_PYTHON={py}: {e}"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"DEEPSPEC_VLLM_PYTHON={py} cannot import vllm: {tail}"
    return None


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if mine and _why_not():
        skip = pytest.mark.skip(reason=_why_not())
        for item in mine:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if _why_not():
        pytest.skip(_why_not())
    return os.environ["DEEPSPEC_VLLM_PYTHON"]

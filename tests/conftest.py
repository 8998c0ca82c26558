"""Shared fixtures: everything runs offline on CPU, on the tiny target unless
a test says otherwise. Session-scoped fixtures build each target once."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("DEEPSPEC_DATA", REPO.parent / "shared" / "data"))

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def resources_dir(tmp_path_factory) -> Path:
    """A private resources/ for the test session."""
    return tmp_path_factory.mktemp("resources")


@pytest.fixture(scope="session")
def tiny_cfg(resources_dir) -> dict:
    """The tiny preset, pointed at the session's resources and the shared data."""
    from deepspec.config import load_config

    return load_config("tiny", {"resources_dir": str(resources_dir), "data": {"root": str(SHARED_DATA)}})


@pytest.fixture(scope="session")
def tiny_target(tiny_cfg):
    from deepspec.targets import target_from_config

    return target_from_config(tiny_cfg)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set DEEPSPEC_DATA)")
    return SHARED_DATA

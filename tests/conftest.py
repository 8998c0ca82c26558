"""Shared fixtures: everything runs offline on CPU, on the tiny target unless
a test says otherwise. Session-scoped fixtures build each target once.

`target` / `target_cfg` run a test on both tiny targets (`target_kind`): the
Llama-style `tiny` and a random Gemma4 one (`gemma4`, deepspec.targets.tiny.build_tiny).
`qwen3_target` / `qwen3_cfg` are a tiny random Qwen3 target (q/k norms) for the
Qwen3-only paths (the standard Eagle3 layer with q/k norms, released-checkpoint
layouts, export)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The prompt data: $DEEPSPEC_DATA, else a prepared copy next to the clone, exported so that
# every test, command and subprocess (Snakemake's jobs included) reads it rather than data/.
if not os.environ.get("DEEPSPEC_DATA") and (REPO.parent / "shared" / "data").is_dir():
    os.environ["DEEPSPEC_DATA"] = str(REPO.parent / "shared" / "data")
SHARED_DATA = Path(os.environ.get("DEEPSPEC_DATA") or REPO.parent / "shared" / "data")

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
    from deepspec.targets.loading import target_from_config

    return target_from_config(tiny_cfg)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set DEEPSPEC_DATA)")
    return SHARED_DATA


GEMMA4_FEATURE_LAYERS = [0, 1, 2]  # sliding, full, sliding (the final layer is not allowed)


def _gemma4_target(target_id: str, multimodal: bool = False):
    from deepspec.core.target import Target, eos_ids_of
    from deepspec.targets.tiny import build_tiny

    model = build_tiny("gemma4", multimodal=multimodal).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id=target_id, eos_token_ids=eos_ids_of(model, None))


@pytest.fixture(scope="session")
def gemma4_target():
    """A tiny random Gemma4ForCausalLM (sliding and full attention layers, a wider
    head and one K/V head on full-attention layers, keys as values, soft-capping;
    512-token vocabulary, no tokenizer)."""
    return _gemma4_target("tiny-gemma4")


@pytest.fixture(scope="session")
def gemma4_wrapped_target():
    """The hub layout: Gemma4ForConditionalGeneration (text only) around the same decoder."""
    return _gemma4_target("tiny-gemma4-mm", multimodal=True)


@pytest.fixture(scope="session")
def gemma4_cfg(tiny_cfg) -> dict:
    """The tiny preset with the Gemma4 target's feature layers."""
    import copy

    c = copy.deepcopy(tiny_cfg)
    c["target"]["feature_layers"] = GEMMA4_FEATURE_LAYERS
    return c


QWEN3_FEATURE_LAYERS = [0, 1]


@pytest.fixture(scope="session")
def qwen3_target():
    """A tiny random Qwen3ForCausalLM (3 layers, q/k norms, untied head, 512 tokens, no tokenizer)."""
    from deepspec.core.target import Target, eos_ids_of
    from deepspec.targets.tiny import build_tiny

    model = build_tiny("qwen3").eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, target_id="tiny-qwen3", eos_token_ids=eos_ids_of(model, None))


@pytest.fixture(scope="session")
def qwen3_cfg(tiny_cfg) -> dict:
    """The tiny preset with the Qwen3 target's feature layers."""
    import copy

    c = copy.deepcopy(tiny_cfg)
    c["target"]["feature_layers"] = QWEN3_FEATURE_LAYERS
    return c


@pytest.fixture(scope="module", params=["tiny", "gemma4"])
def target_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(target_kind, request):
    return request.getfixturevalue("tiny_target" if target_kind == "tiny" else "gemma4_target")


@pytest.fixture(scope="module")
def target_cfg(target_kind, request) -> dict:
    return request.getfixturevalue("tiny_cfg" if target_kind == "tiny" else "gemma4_cfg")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module (decoding tests that time themselves)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

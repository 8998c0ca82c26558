"""Shared by the vLLM loader tests (test_engine_loaders.py, test_speculators.py): a tiny
Qwen3 target vLLM's CPU attention accepts (head_dim 32) saved as a HF directory, random
drafters for it, and deepspec/serving/engine_side/loadcheck.py run with the vLLM python."""
import json
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from deepspec.formats import convert

from helpers import random_drafter

REPO = Path(__file__).resolve().parents[2]
LOADCHECK = REPO / "deepspec" / "serving" / "engine_side" / "loadcheck.py"
HEAD_DIM = 32  # vLLM's CPU attention backend's smallest supported head size


def vllm_target(where: Path, arch: str = "qwen3"):
    """The tiny target (Qwen3, or Llama as SmolLM2 is) with head_dim 32, and its HF
    directory (what vLLM reads as the target)."""
    from deepspec.core.target import Target, eos_ids_of
    from deepspec.targets.tiny import build_tiny

    layers = {"num_hidden_layers": 3} if arch == "llama" else {}  # the Qwen3 tiny's depth: the same feature layers
    model = build_tiny(arch, head_dim=HEAD_DIM, **layers).eval().requires_grad_(False)
    model.config.architectures = [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]
    model.save_pretrained(where)
    return Target(model=model, tokenizer=None, target_id=str(where), eos_token_ids=eos_ids_of(model, None)), where


def drafter(method, target, cfg, **settings):
    return random_drafter(method, target, cfg, **settings)[0]


def run_loadcheck(python: str, cases: list, where: Path) -> dict:
    """vllm_loadcheck.py over `cases` in one vLLM process; its result per case name."""
    req, res = where / "request.json", where / "result.json"
    req.write_text(json.dumps({"cases": cases, "dtype": "float32"}))
    r = subprocess.run([python, str(LOADCHECK), str(req), str(res)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and res.exists(), f"vllm_loadcheck.py exited {r.returncode}:\n{r.stderr[-4000:]}"
    return json.loads(res.read_text())


def assert_export_is_the_drafter(out: Path, d, target) -> None:
    """Every exported tensor is the drafter's (reference names) or the target's copy,
    bit for bit; a null Markov head is zero."""
    sd, ours = load_file(str(out / "model.safetensors")), d.state_dict()
    cfg = json.loads((out / "config.json").read_text())
    appended = cfg.get(convert.MASK_APPENDED_FIELD)  # the learned mask embedding as row V (export.py)
    V = target.vocab_size
    for name, t in sd.items():
        if name == "embed_tokens.weight" and appended:
            vocab = cfg.get("transformer_layer_config", cfg)["vocab_size"]  # speculators: the layers' config
            assert t.shape[0] == V + 1 == vocab and cfg["mask_token_id"] == V
            assert torch.equal(t[:V], target.embed_tokens.weight) and torch.equal(t[V], d.mask_embedding)
        elif name == "embed_tokens.weight":
            assert torch.equal(t, target.embed_tokens.weight)
        elif name == "lm_head.weight":
            rows = d.d2t if d.reduced_vocab else slice(None)
            assert torch.equal(t, target.lm_head.weight[rows])
        elif name == "d2t":
            assert torch.equal(torch.arange(t.numel()) + t, d.d2t)
        elif cfg.get(convert.NULL_MARKOV_FIELD) and name in convert.NULL_MARKOV_TENSORS:
            assert not t.any()
        elif appended and name == convert.NULL_MARKOV_TENSORS[0]:  # markov_w1: a zero row for the mask token
            assert torch.equal(t[:V], ours[convert.to_ours(name)]) and not t[V].any()
        else:
            assert torch.equal(t, ours[convert.to_ours(name)]), name


def assert_loaded_bit_for_bit(res: dict, padded: set = frozenset()) -> None:
    """Every parameter vLLM holds is the export's tensor (only the placeholder
    mask_embedding, which vLLM's DSpark loader maps away by design, is not loaded),
    nothing was dropped, and the CPU post-processing ran."""
    assert "error" not in res, res.get("traceback", res.get("error"))
    assert res["differ"] == [] and res["dropped"] == [], (res["differ"], res["dropped"])
    assert res["not_loaded"] == ["model.mask_embedding"]
    assert set(res["padded_rows"]) == set(padded)
    assert len(res["compared"]) > 20 and res["post_processed"] is True

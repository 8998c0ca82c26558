"""SGLang's own model classes and weight loaders on export-checkpoint's SGLang
exports (tests/engine/test_sglang_loaders.py).

Run by path with a python in which `import sglang` works (it imports only sglang,
torch, transformers, safetensors and the standard library, never deepspec):

    $SGLANG_PYTHON deepspec/serving/engine_side/sglang_loadcheck.py REQUEST.json RESULT.json

REQUEST.json: {"cases": [{"name", "draft": export dir}]}. For each case, under the
environment the export's config asks SGLang to run with
(`deepspec_serve_sglang.env`, e.g. SGLANG_RAGGED_VERIFY_MODE), this builds the
class its `architectures` names the way SGLang's model loader does
(`Qwen3DSparkModel` from sglang/srt/models/dspark.py, `LlamaForCausalLMEagle3`
from llama_eagle3.py; the config read by transformers' AutoConfig), on CPU with
every parameter first set to NaN, and feeds `load_weights` the export's tensors.
RESULT.json: per case the class, SGLang's view of the config (block size, Markov
rank and head type, mask token, confidence head), every parameter SGLang holds
(name -> shape), those its speculative worker replaces with the target's
(`attached_from_target`), the others no tensor reached (still NaN: SGLang's
loaders skip names they do not know without a word) and the loaded values
(`<name>.safetensors` beside RESULT.json), or the error.

Building an SGLang model outside the server needs: the parallel layout published
(`runtime_context.publish` of a default ServerArgs on CPU, as SGLang's own
test_utils.publish_build_topology does), a one-process gloo group
(`init_distributed_environment` + `initialize_model_parallel`), and, off CUDA, a
module `vllm._custom_ops` to import: SGLang's RotaryEmbedding binds vLLM's rotary
kernel there on platforms it has no kernel for, and only its forward would call
it. Nothing here runs a forward.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import types
from pathlib import Path

import torch

ARCHITECTURES = {"Qwen3DSparkModel": "sglang.srt.models.dspark",
                 "LlamaForCausalLMEagle3": "sglang.srt.models.llama_eagle3"}


def _rotary_kernel_placeholder() -> None:
    """`vllm._custom_ops.rotary_embedding` for SGLang's RotaryEmbedding to bind (see the docstring)."""
    try:
        import vllm._custom_ops  # noqa: F401  a real vLLM beside SGLang
    except ImportError:
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules["vllm._custom_ops"] = ops


def _one_process_group() -> None:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel()


def settings(model, config) -> dict:
    out = {"model_class": type(model).__name__}
    if hasattr(model, "markov_head"):
        from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

        dc = parse_dspark_draft_config(draft_hf_config=config)
        conf = getattr(model, "confidence_head", None)
        out.update(gamma=int(model.gamma), block_size=int(model.block_size), markov_rank=dc.markov_rank,
                   markov_head_type=dc.markov_head_type, markov_class=type(model.markov_head).__name__,
                   mask_token_id=dc.mask_token_id, target_layer_ids=list(dc.target_layer_ids or []),
                   sample_from_anchor=bool(model.sample_from_anchor), confidence_head=conf is not None,
                   confidence_with_markov=None if conf is None else bool(getattr(conf, "with_markov", False)),
                   draft_layers=len(model.layers))
    else:  # EAGLE-3
        out.update(draft_vocab_size=int(config.draft_vocab_size), draft_layers=len(model.model.layers),
                   hot_token_id=model.hot_token_id is not None,
                   aux_layer_ids=list((getattr(config, "eagle_config", None) or {}).get(
                       "eagle_aux_hidden_state_layer_ids") or []),
                   load_lm_head_from_target=bool(model.load_lm_head_from_target))
    return out


def check_case(case: dict, where: Path) -> dict:
    import importlib

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    draft = Path(case["draft"])
    raw = json.loads((draft / "config.json").read_text())
    env = (raw.get("deepspec_serve_sglang") or {}).get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        arch = raw["architectures"][0]
        cls = getattr(importlib.import_module(ARCHITECTURES[arch]), arch)
        config = AutoConfig.from_pretrained(str(draft))
        with torch.device("cpu"):
            model = cls(config)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        tensors = {}
        for f in sorted(draft.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        model.load_weights(list(tensors.items()))
        params = dict(model.named_parameters())
        # what SGLang's speculative worker replaces with the target's: a DSpark draft holds no
        # embedding or head of its own (attach_shared_modules); an EAGLE-3 draft gets the target's
        # embedding always and its head where load_lm_head_from_target (eagle_worker_v2.init_lm_head)
        attached = sorted(n for n in params if n == "model.embed_tokens.weight"
                          or (n == "lm_head.weight" and getattr(model, "load_lm_head_from_target", False)))
        not_loaded = sorted(n for n, p in params.items() if n not in attached and torch.isnan(p).any())
        out_file = where / f"{case['name']}.safetensors"
        save_file({n: p.detach().contiguous() for n, p in params.items() if n not in attached}, str(out_file))
        return {"env": env, "architecture": arch, "params": {n: list(p.shape) for n, p in params.items()},
                "attached_from_target": attached, "not_loaded": not_loaded, "loaded_file": str(out_file),
                "settings": settings(model, config)}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main(argv) -> int:
    request = json.loads(Path(argv[0]).read_text())
    where = Path(argv[1]).parent
    _rotary_kernel_placeholder()
    _one_process_group()
    import sglang
    from cases import run_cases  # engine_side/cases.py, beside this script

    return run_cases(request, argv[1], lambda case: check_case(case, where), {"sglang": sglang.__version__})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

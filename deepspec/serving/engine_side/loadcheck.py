"""vLLM's own loader on export-checkpoint's DSpark / DFlash exports (tests/engine/).

Run by path with a python in which `import vllm` works (it imports only vllm,
torch and the standard library, never deepspec):

    $VLLM_PYTHON deepspec/serving/engine_side/loadcheck.py REQUEST.json RESULT.json

REQUEST.json: {"cases": [{"name", "draft": export dir, "target": HF dir of the
target (config.json), or "speculators": true (the target is the verifier the
export names, resolved by vLLM's own `maybe_override_with_speculators`), and
optionally "spec": the speculative config without its model (default
{"method": "dspark"})}],
"dtype": "float32"}. For each case this builds the speculative config as `vllm
serve` would (method "dspark", or what the speculators format says), then the
draft model the way vLLM's model loader does (`create_model` under the draft's
dtype, `load_weights` over vLLM's own safetensors iterator), compares every
parameter vLLM holds with the export's tensor bit for bit (q/k/v and gate/up
stacked as vLLM stacks them; rows beyond the tensor are vocabulary padding),
and runs the loader's post-processing (`process_weights_after_loading`, where
the CPU platform sets up its GEMMs). RESULT.json: per case the settings vLLM
read (method, class, num_speculative_tokens, mask token, aux layer ids,
sample_from_anchor, Markov rank, confidence head, ...), the parameters that
differ, were not loaded or were dropped, or the error.

Building a vLLM model outside the engine needs: a VllmConfig whose speculative
config is attached after construction (its validation refuses dspark on the
V1 model runner, the one vLLM picks on a CPU without Triton; the model class and
its loader do not depend on the runner), `set_current_vllm_config`, and a
one-process gloo group (`init_distributed_environment` + `initialize_model_parallel`).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def expected_params(files) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> the tensor it must hold, from the export's checkpoint
    names (Qwen3DSparkForCausalLM.load_weights: "model." prefix except lm_head, d2t ->
    draft_id_to_target_id, t2d skipped; the stacked projections in shard order)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    flat, parts = {}, {}
    for name, t in safetensors_weights_iterator(files, False):
        if "t2d" in name:
            continue
        if name == "d2t":
            flat["draft_id_to_target_id"] = t
            continue
        full = name if name.startswith("lm_head") else "model." + name
        leaf = full.split(".")[-2]
        if leaf in STACKED:
            fused, idx = STACKED[leaf]
            parts.setdefault(full.replace(f".{leaf}.", f".{fused}."), {})[idx] = t
        else:
            flat[full] = t
    for name, shards in parts.items():
        flat[name] = torch.cat([shards[i] for i in sorted(shards)], 0)
    return flat


def compare(model, want: dict) -> dict:
    have = dict(model.named_parameters())
    differ, padded = [], {}
    for name, p in have.items():
        if name not in want:
            continue
        w = want[name].to(p.dtype)
        if p.shape == w.shape:
            ok = torch.equal(p.data, w)
        elif p.dim() == w.dim() and p.shape[1:] == w.shape[1:] and p.shape[0] > w.shape[0]:
            ok = torch.equal(p.data[: w.shape[0]], w)  # vocabulary padding rows
            padded[name] = int(p.shape[0] - w.shape[0])
        else:
            ok = False
        if not ok:
            differ.append(f"{name} {tuple(p.shape)} vs {tuple(w.shape)}")
    return {"compared": sorted(set(have) & set(want)), "differ": differ, "padded_rows": padded,
            "not_loaded": sorted(set(have) - set(want)), "dropped": sorted(set(want) - set(have))}


def settings(model, sc) -> dict:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    hf, inner = sc.draft_model_config.hf_config, model.model
    conf = getattr(inner, "confidence_head", None)
    markov = getattr(inner, "markov_head", None)
    return {"method": sc.method, "architectures": list(sc.draft_model_config.architectures),
            "model_class": type(model).__name__, "num_speculative_tokens": sc.num_speculative_tokens,
            "mask_token_id": get_parallel_drafting_token_id(hf), "model_mask_token_id": inner.mask_token_id,
            "aux_layer_ids": list(get_eagle3_aux_layers_from_config(sc) or []),
            "target_layer_ids": list(getattr(hf, "target_layer_ids", None) or []),
            # DSparkSpeculator: sample_from_anchor defaults to True (anchor predicts draft token 1)
            "sample_from_anchor": bool(getattr(hf, "sample_from_anchor", True)),
            "dspark_bonus_anchor": bool(getattr(hf, "dspark_bonus_anchor", False)),
            "block_size": getattr(hf, "block_size", None), "markov_head_type": getattr(hf, "markov_head_type", None),
            "markov_rank": None if markov is None else int(markov.markov_w1.embedding_dim),
            "confidence_head": conf is not None, "confidence_with_markov": None if conf is None else bool(conf.with_markov),
            "fc_input_size": int(inner.fc.input_size), "draft_layers": len(inner.layers),
            "reduced_vocab": model.draft_id_to_target_id is not None, "dtype": str(sc.draft_model_config.dtype),
            # load_dspark_model (v1/worker/gpu/spec_decode/dspark/utils.py) shares the target's embed_tokens
            # only when the draft's input vocabulary is not larger than the target's
            "draft_input_vocab": int(sc.draft_model_config.get_vocab_size()),
            "target_vocab": int(sc.target_model_config.get_vocab_size())}


def check_case(case: dict, dtype: str) -> dict:
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.utils.torch_utils import set_default_torch_dtype

    draft, target = case["draft"], case.get("target")
    if case.get("speculators"):
        target, _, spec = maybe_override_with_speculators(model=draft, tokenizer=None, trust_remote_code=False)
    else:  # `vllm serve TARGET --speculative-config SPEC` with the export as its model
        spec = dict(case.get("spec") or {"method": "dspark"}, model=draft)
    mc = ModelConfig(model=target, dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
    pc = ParallelConfig()
    sc = SpeculativeConfig(**spec, target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, parallel_config=pc, device_config=DeviceConfig("cpu"))
    vc.speculative_config = sc
    dmc = sc.draft_model_config
    out = {"speculative_config": {k: v for k, v in spec.items() if k != "model"}, "verifier": str(target)}
    with set_current_vllm_config(vc):
        _one_process_group()
        loader = get_model_loader(vc.load_config)
        with set_default_torch_dtype(dmc.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vc, model_config=dmc)
        loader.load_weights(model, dmc)
        files = sorted(str(p) for p in Path(draft).glob("*.safetensors"))
        out.update(compare(model, expected_params(files)))
        out["settings"] = settings(model, sc)
        process_weights_after_loading(model, dmc, torch.device("cpu"))
        out["post_processed"] = True
    return out


def _one_process_group() -> None:
    """World size 1 on gloo, tensor and pipeline parallel 1 (once per process)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-loadcheck-')}")
        initialize_model_parallel(1, 1)


def main(argv) -> int:
    from cases import run_cases  # engine_side/cases.py, beside this script

    request = json.loads(Path(argv[0]).read_text())
    return run_cases(request, argv[1], lambda case: check_case(case, request.get("dtype", "float32")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

import json
import resource
import subprocess
import sys

import pytest
import torch

from deepspec.core.target import check_feature_layers, select_features
from deepspec.errors import DeepSpecError
from deepspec.targets.loading import load_target, prepare_target

from helpers import copy_workflow, local_rules


def test_smollm2_converts_reloads_offline_and_answers_paris(tmp_path):
    from transformers import AutoModelForCausalLM

    out = prepare_target("smollm2-135m", tmp_path / "smollm2-135m")
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)  # plain HF checkpoint
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    target = load_target("smollm2-135m", path=out)
    assert target.eos_token_ids == (2,) and target.vocab_size == 49152
    ids = torch.tensor([target.chat_ids([{"role": "user", "content": "What is the capital of France?"}])])
    gen = target.model.generate(ids, max_new_tokens=16, do_sample=False)
    text = target.tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_gguf_reader_equals_transformers_gguf_loader():
    """Our one-pass GGUF conversion (q/k rows un-permuted, Q4_1/Q8_0 de-quantized)
    is transformers' own GGUF loading bit for bit: every tensor, the config, the logits."""
    from transformers import AutoModelForCausalLM

    from deepspec.targets.loading import SMOLLM2_GGUF, _load_smollm2_gguf, _smollm2_dir

    ours, _ = _load_smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(_smollm2_dir()), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    a, b = ref.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF
    skip = {"_model_name_or_path", "_name_or_path", "dtype", "transformers_version", "quantization_config"}
    ref_cfg = {k: v for k, v in ref.config.to_dict().items() if k not in skip}
    assert {k: v for k, v in ours.config.to_dict().items() if k not in skip} == ref_cfg
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_gguf_names_outside_llama_are_refused():
    from deepspec.targets.gguf import _hf_name

    assert _hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert _hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(DeepSpecError, match="blk.0.attn_qkv.weight"):
        _hf_name("blk.0.attn_qkv.weight")


def test_tiny_target_features(tiny_target, tiny_cfg):
    t = tiny_target
    assert t.num_layers == 2 and t.hidden_size == 64
    ids = torch.tensor([t.chat_ids([{"role": "user", "content": "Hello there"}])])
    layers = tiny_cfg["target"]["feature_layers"]
    feats, last = t.features(ids, layers)
    assert feats.shape == (1, ids.shape[1], 64 * len(layers)) and last.shape == (1, ids.shape[1], 64)
    out = t.model(ids, output_hidden_states=True)
    # hidden_states[l+1] is layer l's output; the last entry is post-norm and gives the logits.
    torch.testing.assert_close(feats[..., :64], out.hidden_states[0])
    torch.testing.assert_close(feats[..., 64:], out.hidden_states[1])
    torch.testing.assert_close(t.lm_head(last), out.logits, atol=1e-4, rtol=1e-4)


def test_tiny_target_is_deterministic_and_peaked(tiny_target, tmp_path):
    again = load_target("tiny", path=prepare_target("tiny", tmp_path / "tiny"))
    for a, b in zip(tiny_target.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    ids = torch.tensor([tiny_target.chat_ids([{"role": "user", "content": "Count to ten."}])])
    p = torch.softmax(tiny_target.model(ids).logits, -1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    assert entropy < 4.0  # far from uniform (log 49152 = 10.8)


def test_final_layer_is_not_a_feature_layer():
    assert check_feature_layers([1, 7, 14, 21, 27], 30) == [1, 7, 14, 21, 27]
    with pytest.raises(DeepSpecError, match="final layer"):
        check_feature_layers([1, 29], 30)
    with pytest.raises(DeepSpecError):
        check_feature_layers([-2], 30)
    hs = [torch.full((1, 1, 2), float(i)) for i in range(4)]
    assert select_features(hs, [-1, 1]).flatten().tolist() == [0, 0, 2, 2]


def test_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(DeepSpecError, match="cannot load target"):
        load_target(str(tmp_path / "nope"))


HEAP_PROBE = """
import resource, sys, torch
from deepspec.runtime import keep_large_allocations_on_heap

def faults():  # minor page faults of five 64 MB tensors made and freed in turn
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(16 << 20)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

before = faults()
applied = keep_large_allocations_on_heap()
warm = [faults() for _ in range(4)]  # the heap grows to its working size
print(applied, before, faults())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc setting")
def test_cpu_runs_keep_large_tensors_on_the_heap():
    """With glibc's mmap off, a large tensor made again, once the heap has grown
    to its working size, reuses heap pages: no fresh mapping (16,384 page
    faults) per tensor as before."""
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True).stdout
    applied, before, after = out.split()
    assert applied == "True"
    pages = (64 << 20) // resource.getpagesize()
    assert int(before) >= 4 * pages  # every tensor a fresh mapping
    assert int(after) <= 1.5 * pages


def _tiny_checkpoint(tmp_path, tiny_target):
    src = tmp_path / "hub-snapshot"
    tiny_target.model.save_pretrained(str(src))
    tiny_target.tokenizer.save_pretrained(str(src))
    (src / "pytorch_model.bin").write_bytes(b"not a checkpoint file deepspec keeps")
    return src


def test_hub_target_is_linked_at_its_revision_without_loading_the_weights(tmp_path, tiny_target, monkeypatch):
    """prepare-target of a hub id: the snapshot at target.revision, its files hard
    linked (no second copy of the weights, no load and re-save in RAM); config.json
    is a new file naming the spec; the result loads like the original."""
    import huggingface_hub
    import transformers

    from deepspec.targets import loading as TG

    src, seen = _tiny_checkpoint(tmp_path, tiny_target), {}

    def fake_snapshot(repo_id, revision=None, allow_patterns=None, **kw):
        seen.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("prepare_target must not load the weights"))
    out = TG.prepare_target("org/model", tmp_path / "out", revision="abc123")
    assert seen["repo_id"] == "org/model" and seen["revision"] == "abc123" and "*.safetensors" in seen["patterns"]
    assert (out / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino
    assert not (out / "pytorch_model.bin").exists()
    assert json.loads((out / "config.json").read_text())["deepspec_target_id"] == "org/model"
    assert json.loads((src / "config.json").read_text()).get("deepspec_target_id") != "org/model"  # cache untouched
    monkeypatch.undo()
    again = load_target("org/model", path=out)
    for a, b in zip(tiny_target.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)


def test_hub_errors_are_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    from deepspec.targets import loading as TG

    def gated(**kw):
        e = GatedRepoError.__new__(GatedRepoError)  # as the hub raises it, without an HTTP response
        OSError.__init__(e, "403 Client Error.\n\nCannot access gated repo for url https://huggingface.co/x.\nmore")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(DeepSpecError, match=r"cannot download target 'google/x' at revision 'v1': GatedRepoError: "
                                            r"403 Client Error\. \(a gated model: .*hf auth login") as e:
        TG.prepare_target("google/x", tmp_path / "out", revision="v1")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []
    with pytest.raises(DeepSpecError, match="applies to hub targets"):
        TG.prepare_target("tiny", tmp_path / "tiny", revision="v1")


def test_prepare_target_rule_is_local_and_passes_the_revision(tmp_path):
    """prepare_target runs where Snakemake runs (a login node has the internet that
    compute nodes may lack; it needs no GPU) and pins target.revision."""
    copy_workflow(tmp_path)
    assert "prepare_target" in (local_rules(tmp_path) or [])
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1",
                        "resources/targets/qwen3-4b/config.json", "--config", "preset=qwen3-4b",
                        "target={revision: 1cfa9a7}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "prepare-target Qwen/Qwen3-4B --revision 1cfa9a7 --out" in out

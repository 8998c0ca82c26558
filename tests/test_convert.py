"""Loading released DeepSpec DFlash/DSpark checkpoints (Eagle3: test_export.py) (deepspec/formats/convert.py):
synthetic reference-layout checkpoints made from random tiny drafters convert
into drafters with bit-identical outputs; malformed ones fail with one line and
leave nothing behind."""
import copy
import json
import os

import pytest
import torch

from deepspec.cli import main as cli_main
from deepspec.drafters import build_drafter, load_drafter
from deepspec.drafters.base import DrafterBase
from deepspec.errors import DeepSpecError
from deepspec.formats import convert, released

from helpers import MASK_ID, gemma4_reference_config, reference_config, write_reference

SEQ = [1, 2, 3, 500, 17, 923, 4411, 60, 7, 311, 2999, 12, 40, 5, 88, 1024]


def _original(method, target, cfg, **drafter):
    """A random tiny drafter whose mask embedding is the target's embedding of
    MASK_ID, i.e. the reference's block input."""
    c = copy.deepcopy(cfg)
    c["drafter"].update(drafter)
    torch.manual_seed(0)
    d = build_drafter(method, target, c).eval()
    with torch.no_grad():  # the embedding module's output (Gemma4's scales by sqrt(d))
        d.mask_embedding.copy_(target.embed_tokens(torch.tensor([MASK_ID]))[0])
    return d






@pytest.fixture(scope="module")
def batch(tiny_target, tiny_cfg):
    ids = torch.tensor([SEQ])
    feats, _ = tiny_target.features(ids, tiny_cfg["target"]["feature_layers"])
    return ids, feats


CASES = {
    "dspark-with-target-copies": ("dspark", {}, dict(with_target_copies=True)),
    "dflash-sharded": ("dflash", {}, dict(shards=2)),
    "dspark-rnn-sharded": ("dspark", {"markov_head_type": "rnn"}, dict(shards=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_converted_drafter_is_identical(tiny_target, tiny_cfg, batch, tmp_path, case):
    method, drafter_kw, write_kw = CASES[case]
    d = _original(method, tiny_target, tiny_cfg, **drafter_kw)
    src = write_reference(d, tiny_target, tmp_path / "ref", **write_kw)
    out = convert.convert_reference_checkpoint(src, tiny_target, tmp_path / "out")
    e = load_drafter(out, tiny_target)
    assert type(e) is type(d) and e.method == method
    assert e.config.deepspec_source["mask_token_id"] == MASK_ID
    assert torch.equal(e.d2t, torch.arange(tiny_target.vocab_size))
    _compare(d, e, *batch)


def _compare(d, e, ids, f):
    """d and e give bit-identical hidden states, block logits, confidence logits and proposals."""
    sd0, sd1 = d.state_dict(), e.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    # Tensors loaded from safetensors may sit at unaligned addresses, where CPU matmul
    # kernels round differently in the last bit; fresh (aligned) copies compare bitwise.
    for t in list(e.parameters()) + list(e.buffers()):
        t.data = t.data.clone()
    anchors = torch.tensor([[4, 9]])
    with torch.no_grad():
        h0, h1 = d(ids, f, anchors), e(ids, f, anchors)
        prev = torch.stack([ids[0, anchors[0] + j] for j in range(d.gamma)], -1).unsqueeze(0)
        assert torch.equal(h0, h1)
        assert torch.equal(d.block_logits(h0, prev), e.block_logits(h1, prev))
        c0, c1 = d.confidence_logits(h0, prev), e.confidence_logits(h1, prev)
        assert (c0 is None and c1 is None) or torch.equal(c0, c1)
    for temperature in (0.0, 1.0):
        props = []
        for m in (d, e):
            st = m.init_state()
            m.propose(st, f[:, :5], ids[:, :6], temperature=temperature, generator=torch.Generator().manual_seed(3))
            props.append(m.propose(st, f[:, 5:9], ids[:, 5:10], temperature=temperature,
                                   generator=torch.Generator().manual_seed(4)))
        p0, p1 = props
        assert torch.equal(p0.tokens, p1.tokens) and torch.equal(p0.probs, p1.probs)
        assert (p0.conf_logits is None and p1.conf_logits is None) or torch.equal(p0.conf_logits, p1.conf_logits)


def test_qwen3_layout_bf16(tiny_cfg, tmp_path):
    """A Qwen3 target (per-head q/k norms in the keys) and a bf16 checkpoint with bf16
    copies of the target's embedding and head, as DeepSeek's releases are stored."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.core.target import Target

    torch.manual_seed(1)
    qc = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    target = Target(model=Qwen3ForCausalLM(qc).eval().requires_grad_(False), tokenizer=None, target_id="qwen3-tiny")
    cfg = copy.deepcopy(tiny_cfg)
    cfg["target"]["feature_layers"] = [0, 1, 2]
    d = _original("dspark", target, cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():  # bf16-representable: the bf16 checkpoint is lossless
            if name != "mask_embedding":  # (not in the checkpoint: the target's row, float32)
                p.copy_(p.bfloat16().float())
    assert any(k.endswith("self_attn.q_norm.weight") for k in d.state_dict())
    src = write_reference(d, target, tmp_path / "ref", with_target_copies=True, dtype=torch.bfloat16, shards=2)
    e = load_drafter(convert.convert_reference_checkpoint(src, target, tmp_path / "out"), target)
    ids = torch.tensor([[x % 512 for x in SEQ]])
    _compare(d, e, ids, target.features(ids, [0, 1, 2])[0])


def _fails(src, target, out, match):
    with pytest.raises(DeepSpecError, match=match) as ei:
        convert.convert_reference_checkpoint(src, target, out)
    msg = str(ei.value)
    assert "\n" not in msg
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return msg


def test_other_architecture_is_refused(tiny_target, tiny_cfg, tmp_path):
    """(DeepSeek's Eagle3 layout converts: tests/test_export.py.)"""
    d = _original("dflash", tiny_target, tiny_cfg)
    cfg = dict(reference_config(d, tiny_target), architectures=["Qwen3MedusaModel"])
    src = write_reference(d, tiny_target, tmp_path / "ref", config=cfg)
    _fails(src, tiny_target, tmp_path / "out", "not a DeepSpec Eagle3/DFlash/DSpark drafter")


def test_unexpected_missing_and_misshapen_tensors(tiny_target, tiny_cfg, tmp_path):
    d = _original("dspark", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "a", extra={"layers.0.self_attn.foo.weight": torch.zeros(2)})
    msg = _fails(src, tiny_target, tmp_path / "out", "unexpected tensor 'layers.0.self_attn.foo.weight'")
    assert "model.safetensors" in msg
    src = write_reference(d, tiny_target, tmp_path / "b", drop=["markov_head.markov_w2.weight"])
    _fails(src, tiny_target, tmp_path / "out", "tensor 'markov_head.markov_w2.weight' missing")
    bad = d.state_dict()["fc.weight"].t().contiguous()
    src = write_reference(d, tiny_target, tmp_path / "c", extra={"fc.weight": bad}, shards=2)
    msg = _fails(src, tiny_target, tmp_path / "out", r"tensor 'fc.weight' has shape \[128, 64\], expected \[64, 128\]")
    assert "-of-00002.safetensors" in msg
    # an output scale in a drafter whose layers have none: an identity one is dropped, another refused
    one, two = torch.ones(1), torch.full((1,), 2.0)
    src = write_reference(d, tiny_target, tmp_path / "e", extra={"layers.0.layer_scalar": one})
    assert load_drafter(convert.convert_reference_checkpoint(src, tiny_target, tmp_path / "e_out"), tiny_target)
    src = write_reference(d, tiny_target, tmp_path / "f", extra={"layers.0.layer_scalar": two})
    _fails(src, tiny_target, tmp_path / "out", "unexpected tensor 'layers.0.layer_scalar'")
    # a gated Markov head has no deepspec counterpart
    cfg = dict(reference_config(d, tiny_target), markov_head_type="gated")
    src = write_reference(d, tiny_target, tmp_path / "d", config=cfg)
    _fails(src, tiny_target, tmp_path / "out", "markov_head_type 'gated' is not supported")


def test_target_mismatch(tiny_target, tiny_cfg, tmp_path):
    d = _original("dflash", tiny_target, tiny_cfg)
    ref = reference_config(d, tiny_target)
    src = write_reference(d, tiny_target, tmp_path / "a", config=dict(ref, hidden_size=128))
    _fails(src, tiny_target, tmp_path / "out", "hidden_size is 128 but the target 'tiny' has 64")
    src = write_reference(d, tiny_target, tmp_path / "b", config=dict(ref, num_target_layers=36))
    _fails(src, tiny_target, tmp_path / "out", "made for a 36-layer target")
    src = write_reference(d, tiny_target, tmp_path / "c", config=dict(ref, target_layer_ids=[0, 1]))
    _fails(src, tiny_target, tmp_path / "out", "target_layer_ids: feature layer 1 out of range")
    other = torch.randn_like(tiny_target.embed_tokens.weight)
    src = write_reference(d, tiny_target, tmp_path / "d", extra={"embed_tokens.weight": other})
    _fails(src, tiny_target, tmp_path / "out", "embed_tokens.weight differs from the target's")


def test_failed_save_leaves_nothing(tiny_target, tiny_cfg, tmp_path, monkeypatch):
    d = _original("dflash", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "ref")

    def broken_save(self, path, **kw):
        (tmp_path / "seen").write_text(str(path))
        open(f"{path}/model.safetensors", "wb").write(b"half")
        raise DeepSpecError("disk full")

    monkeypatch.setattr(DrafterBase, "save_pretrained", broken_save)
    _fails(src, tiny_target, tmp_path / "out", "disk full")
    seen = (tmp_path / "seen").read_text()
    assert seen.startswith(str(tmp_path / ".out.")) and not os.path.exists(seen)


def test_cli_and_resolve(tiny_target, tiny_cfg, tmp_path, capsys):
    d = _original("dspark", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "dspark_tiny_block7")
    sets = ["--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
            "--set", f"data.root={tiny_cfg['data']['root']}"]
    assert cli_main(["convert-checkpoint", "--src", str(src), "--out", str(tmp_path / "out"), *sets]) == 0
    assert load_drafter(tmp_path / "out", tiny_target).method == "dspark"
    assert cli_main(["convert-checkpoint", "--src", str(src), "--out", str(tmp_path / "out"), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("deepspec convert-checkpoint: error:") and "exists" in err
    # --overwrite replaces the earlier conversion, never a folder that is not a deepspec output (X2)
    assert cli_main(["convert-checkpoint", "--src", str(src), "--out", str(tmp_path / "out"), "--overwrite", *sets]) == 0
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "notes.txt").write_text("precious")
    assert cli_main(["convert-checkpoint", "--src", str(src), "--out", str(tmp_path / "victim"), "--overwrite", *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("is not an output directory deepspec wrote (no .deepspec-output in it): --overwrite replaces only "
                        "deepspec's own outputs; remove it yourself or choose another output"), err
    assert [p.name for p in (tmp_path / "victim").iterdir()] == ["notes.txt"]

    cfg = dict(tiny_cfg, resources_dir=str(tmp_path / "resources"))
    path = released.resolve_drafter(str(src), tiny_target, cfg, method="dspark")
    done = tmp_path / "resources" / "drafters" / "tiny" / "dspark_tiny_block7" / "config.json"
    assert path == str(done.parent)
    mtime = done.stat().st_mtime_ns
    assert released.resolve_drafter(str(src), tiny_target, cfg) == path  # converted once, then reused
    assert done.stat().st_mtime_ns == mtime
    assert released.resolve_drafter(path, tiny_target, cfg) == path  # a deepspec drafter is returned as is
    with pytest.raises(DeepSpecError, match="is a dspark checkpoint, not dflash"):
        released.resolve_drafter(str(src), tiny_target, cfg, method="dflash")
    with pytest.raises(DeepSpecError, match="cannot download it from the hub"):
        released.resolve_drafter("deepseek-ai/no_such_drafter_for_tests", tiny_target, cfg)


def test_evaluate_released_checkpoint(tiny_target, tiny_cfg, tmp_path, shared_data):
    """eval.released_checkpoints (what the evaluate rule passes) pointing at a
    reference checkpoint: evaluate converts it once and scores it."""
    from deepspec.evaluation.evaluate import cli_evaluate

    d = _original("dflash", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "dflash_tiny_block7", shards=2)
    resources = tmp_path / "resources"
    (resources / "targets").mkdir(parents=True)
    (resources / "targets" / "tiny").symlink_to(os.path.join(tiny_cfg["resources_dir"], "targets", "tiny"))
    args = ["--preset", "tiny", "--set", f"resources_dir={resources}", "--set", f"data.root={tiny_cfg['data']['root']}",
            "--set", f"results_dir={tmp_path / 'results'}", "--set", "data.benchmarks.gsm8k.cap=1",
            "--set", "eval.max_new_tokens=8", "--set", "eval.n_boot=20",
            "--set", f"eval.released_checkpoints.dflash={src}", "--method", "dflash", "--benchmark", "gsm8k"]
    assert cli_evaluate(args) == 0
    summary = json.loads((tmp_path / "results" / "tiny" / "eval" / "dflash" / "gsm8k.json").read_text())
    assert summary["drafter"] == str(resources / "drafters" / "tiny" / "dflash_tiny_block7") and summary["rounds"] >= 1


# --------------------------------------------------------------------------- Gemma4




G4_CASES = {  # layer_scalar values (None: not in the checkpoint), config layout, write_reference kwargs
    "with-layer-scalar": ([0.5, 1.25], "fields", dict(with_target_copies=True, shards=2)),
    "ones-layer-scalar-per-layer-config": ([1.0, 1.0], "per_layer", {}),
    "without-layer-scalar": (None, "fields", dict(shards=2)),
}


@pytest.mark.parametrize("case", list(G4_CASES))
def test_gemma4_converted_drafter_is_identical(gemma4_target, gemma4_cfg, tmp_path, case):
    """A Gemma4 DSpark checkpoint: layers.{i}.layer_scalar copied exactly (ones when
    absent, as the reference initialises it); the draft geometry checked against
    the full-attention geometry, not the target's ambiguous per-layer fields."""
    scalars, layout, write_kw = G4_CASES[case]
    d = _original("dspark", gemma4_target, gemma4_cfg)
    assert len(d.layers) == 2 and d.config.head_dim == 32 and d.config.num_key_value_heads == 1
    with torch.no_grad():
        for layer, s in zip(d.layers, scalars or [1.0] * len(d.layers)):
            layer.layer_scalar.fill_(s)
    drop = [f"layers.{i}.layer_scalar" for i in range(len(d.layers))] if scalars is None else []
    src = write_reference(d, gemma4_target, tmp_path / "ref", config=gemma4_reference_config(d, gemma4_target, layout),
                          drop=drop, **write_kw)
    out = convert.convert_reference_checkpoint(src, gemma4_target, tmp_path / "out")
    e = load_drafter(out, gemma4_target)
    assert type(e) is type(d) and e.method == "dspark" and e.config.head_dim == 32
    want = torch.tensor(scalars or [1.0] * len(d.layers))
    assert torch.equal(torch.cat([layer.layer_scalar for layer in e.layers]), want)
    assert torch.equal(e.mask_embedding, gemma4_target.embed_tokens(torch.tensor([MASK_ID]))[0])
    ids = torch.tensor([[x % 512 for x in SEQ]])
    _compare(d, e, ids, gemma4_target.features(ids, gemma4_cfg["target"]["feature_layers"])[0])


def test_gemma4_mismatches_are_refused(gemma4_target, gemma4_cfg, tmp_path):
    d = _original("dspark", gemma4_target, gemma4_cfg)
    ref = gemma4_reference_config(d, gemma4_target, "fields")
    src = write_reference(d, gemma4_target, tmp_path / "a", config=dict(ref, global_head_dim=64))
    _fails(src, gemma4_target, tmp_path / "out", "head_dim is 64 but the target 'tiny-gemma4' has 32")
    src = write_reference(d, gemma4_target, tmp_path / "b", config=dict(ref, num_global_key_value_heads=2))
    _fails(src, gemma4_target, tmp_path / "out", "num_key_value_heads is 2 but the target 'tiny-gemma4' has 1")
    src = write_reference(d, gemma4_target, tmp_path / "c", extra={"layers.1.layer_scalar": torch.ones(2)})
    _fails(src, gemma4_target, tmp_path / "out", r"tensor 'layers.1.layer_scalar' has shape \[2\], expected \[1\]")


def test_truncated_safetensors_is_one_line(tiny_target, tiny_cfg, tmp_path):
    d = _original("dflash", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "ref")
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    msg = _fails(src, tiny_target, tmp_path / "out", "not a readable safetensors file")
    assert msg.startswith(str(weights))
    weights.write_bytes(b"\x08\x00")  # not even a header length
    _fails(src, tiny_target, tmp_path / "out", "not a readable safetensors file")


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_out_that_is_contains_or_lies_inside_src_is_refused(tiny_target, tiny_cfg, tmp_path, capsys):
    d = _original("dflash", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "runs" / "ref")
    before = _tree(tmp_path)
    sets = ["--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
            "--set", f"data.root={tiny_cfg['data']['root']}"]
    for out, how in ((src, "is"), (src / "converted", "lies inside"), (tmp_path / "runs", "contains"),
                     (src / ".." / "ref", "is")):
        rc = cli_main(["convert-checkpoint", "--src", str(src), "--out", str(out), "--overwrite", *sets])
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert rc == 2 and len(err) == 1 and f" {how} --src " in err[0], err
        assert _tree(tmp_path) == before


def _nan_at_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def test_a_non_finite_source_tensor_is_refused_before_anything_is_written(tiny_target, tiny_cfg, tmp_path, capsys):
    """A NaN in the source checkpoint is one line naming the source file and tensor;
    no --out is written (the reload used to refuse the written output, naming the
    output and advising to retrain a download)."""
    d = _original("dspark", tiny_target, tiny_cfg)
    name = "markov_head.markov_w1.weight"
    w = convert.to_reference("layers.0.mlp.up_proj.weight")
    sd = {convert.to_reference(k): v.detach() for k, v in d.state_dict().items()}
    src = write_reference(d, tiny_target, tmp_path / "ref", extra={name: _nan_at_first(sd[name])})
    msg = _fails(src, tiny_target, tmp_path / "out", rf"tensor '{name}' has 1 non-finite value")
    assert msg.startswith(str(src / "model.safetensors")) and "retrain" not in msg
    src = write_reference(d, tiny_target, tmp_path / "ref2", shards=2, extra={w: _nan_at_first(sd[w])})
    msg = _fails(src, tiny_target, tmp_path / "out", rf"tensor '{w}' has 1 non-finite value")
    assert "-of-00002.safetensors" in msg
    sets = ["--preset", "tiny", "--set", f"resources_dir={tiny_cfg['resources_dir']}",
            "--set", f"data.root={tiny_cfg['data']['root']}"]
    assert cli_main(["convert-checkpoint", "--src", str(src), "--out", str(tmp_path / "out"), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in err if "error" in x]) == 1 and str(src) in err[-1], err
    assert not (tmp_path / "out").exists()


def test_resolve_never_keeps_a_damaged_conversion(tiny_target, tiny_cfg, tmp_path):
    """A cached conversion under resources/drafters that holds a NaN (as an older deepspec
    wrote from a damaged source) is converted again from an intact source, and removed,
    with the source named, when the source is damaged too; never returned as it is."""
    from safetensors.torch import load_file, save_file

    d = _original("dflash", tiny_target, tiny_cfg)
    src = write_reference(d, tiny_target, tmp_path / "dflash_ref")
    cfg = dict(tiny_cfg, resources_dir=str(tmp_path / "resources"))
    path = released.resolve_drafter(str(src), tiny_target, cfg)
    weights = os.path.join(path, "model.safetensors")

    def damage(f):
        sd = load_file(f)
        k = next(k for k, v in sd.items() if v.is_floating_point())
        sd[k] = _nan_at_first(sd[k])
        save_file(sd, f, metadata={"format": "pt"})

    damage(weights)
    with pytest.raises(DeepSpecError, match=rf"non-finite value.*converted from {src}; check that checkpoint"):
        load_drafter(path, tiny_target)
    assert released.resolve_drafter(str(src), tiny_target, cfg) == path  # converted again
    assert load_drafter(path, tiny_target).method == "dflash"
    damage(weights)
    damage(str(src / "model.safetensors"))  # the source damaged too
    with pytest.raises(DeepSpecError, match=rf"^{src}/model\.safetensors: tensor '.*' has 1 non-finite value"):
        released.resolve_drafter(str(src), tiny_target, cfg)
    assert not os.path.exists(path)

import json
import shutil

import pytest
import torch

from deepspec.cli import main
from deepspec.config import load_config, parse_set
from deepspec.data import cache
from deepspec.data.cache import PROGRESS, build_cache, plan_shards, sha256_file, validate_cache
from deepspec.data.datasets import collate, make_train_dataset, train_collate
from deepspec.errors import DeepSpecError


@pytest.fixture(scope="module")
def setup(tiny_cfg, tiny_target, shared_data, tmp_path_factory):
    """Tiny preset, 8 prompts regenerated through the CLI; small shards so the
    cache has several, with padded forward batches of up to 4 (on this CPU a
    padded batch changes some samples' bits, so online mode must replay them)."""
    root = tmp_path_factory.mktemp("cache_test")
    sets = [
        f"resources_dir={tiny_cfg['resources_dir']}", f"data.root={shared_data}", f"results_dir={root / 'results'}",
        "regenerate.max_new_tokens=16", "cache.shard_tokens=400", "cache.batch_size=4",
    ]
    args = ["--preset", "tiny", *[x for s in sets for x in ("--set", s)]]
    assert main(["regenerate", *args, "--limit", "8"]) == 0
    cfg = load_config("tiny", parse_set(sets))
    convs = root / "results" / "tiny" / "regen" / "conversations.jsonl"
    ref = root / "ref_cache"
    build_cache(cfg, convs, ref, target=tiny_target)
    return dict(cfg=cfg, args=args, convs=convs, ref=ref, root=root)


def _checksums(d):
    return {p.name: sha256_file(p) for p in sorted(d.iterdir())}


def test_cli_regenerate_build_validate(setup, capsys):
    out = setup["root"] / "results" / "tiny" / "cache"
    assert main(["build-cache", *setup["args"]]) == 0  # default paths from the preset
    assert main(["validate-cache", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {out}")
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "deepspec-target-cache" and m["feature_layers"] == [-1, 0] and m["dtype"] == "bfloat16"
    assert m["hidden_size"] == 64 and m["num_samples"] >= 6 and len(m["shards"]) >= 2
    assert m["num_tokens"] == sum(s["num_tokens"] for s in m["shards"])
    assert 389 <= m["bytes_per_token"] < 389 + 30  # ids + mask + 3 x 64 bf16, plus headers/offsets
    assert _checksums(out) == _checksums(setup["ref"])  # a separate build of the same data: same bytes


def test_online_features_equal_a_cache_built_the_same_way(setup, tiny_target, tmp_path, monkeypatch):
    """Online mode runs ONE target forward per micro batch over exactly its
    sequences: at micro batch 1 the features are bit-identical to a cache built
    at cache.batch_size 1 (same fingerprint); a micro batch of 3 agrees with the
    batch-4 cache up to bf16 rounding."""
    cfg = setup["cfg"]
    cfg1 = {**cfg, "cache": {**cfg["cache"], "batch_size": 1}}
    build_cache(cfg1, setup["convs"], tmp_path / "b1", target=tiny_target)
    cached1 = make_train_dataset(cfg1, cache_dir=tmp_path / "b1")
    cached4 = make_train_dataset(cfg, cache_dir=setup["ref"])
    online_cfg = {**cfg, "cache": {**cfg["cache"], "mode": "online"}, "train": {**cfg["train"], "micro_batch": 1}}
    online = make_train_dataset(online_cfg, tiny_target, conversations=setup["convs"])
    assert len(cached1) == len(online) and cached1.ids == online.ids == cached4.ids
    assert online.fingerprint == cached1.fingerprint != cached4.fingerprint
    assert set(online[0]) == {"input_ids", "loss_mask"}  # tokens only: no features held on the host

    calls = []
    features = tiny_target.features
    # patched on the class: an instance attribute would outlive the test (monkeypatch
    # restores it as an attribute bound to tiny_target, which copies of it then share)
    unbound = type(tiny_target).features
    monkeypatch.setattr(type(tiny_target), "features",
                        lambda self, ids, *a, **k: calls.append(tuple(ids.shape)) or unbound(self, ids, *a, **k))
    source = train_collate(online)
    for i in torch.randperm(len(online), generator=torch.Generator().manual_seed(0)).tolist():
        a, b = collate([cached1[i]]), source([online[i]])
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (i, k)
    assert calls == [(1, len(online[i]["input_ids"])) for i in torch.randperm(
        len(online), generator=torch.Generator().manual_seed(0)).tolist()]  # one forward of one sequence each

    idx = [2, 0, 5]
    calls.clear()
    a, b = collate([cached4[i] for i in idx]), source([online[i] for i in idx])
    assert calls == [(3, max(len(online[i]["input_ids"]) for i in idx))]  # one forward over the micro batch only
    for k in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(a[k], b[k])
    for k in ("features", "last_hidden"):
        assert b[k].dtype == torch.float32
        torch.testing.assert_close(b[k], a[k], atol=0.05, rtol=0.02)
        assert not b[k][~b["attention_mask"]].any()  # padded positions are zero, as collate pads the cache's
    assert source.counters() == {"online_target_forwards": len(online) + 1,
                                 "online_target_tokens": sum(len(online[i]["input_ids"]) for i in range(len(online)))
                                 + sum(len(online[i]["input_ids"]) for i in idx),
                                 "online_target_padded_tokens": sum(len(online[i]["input_ids"]) for i in range(len(online)))
                                 + b["attention_mask"].numel()}
    # and the features are the target's: one sample alone, fp32, equals them up to the cache's rounding
    # (bf16 storage, and bf16 compute where cache.precision resolves to it: test_precision.py's 3 %)
    s = cached4[0]
    feats, last = features(s["input_ids"][None], cfg["target"]["feature_layers"])
    for got, ref in ((s["features"], feats[0]), (s["last_hidden"], last[0])):
        assert float((got - ref).norm() / ref.norm()) < 0.03
    assert s["loss_mask"].any() and not s["loss_mask"][0]


def test_corrupt_or_missing_shard_is_reported_and_repaired(setup, tiny_target, tmp_path, capsys):
    d = tmp_path / "cache"
    shutil.copytree(setup["ref"], d)
    shard = d / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DeepSpecError, match="shard-00001.safetensors is corrupt: sha256"):
        validate_cache(d)
    assert main(["validate-cache", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "shard-00001.safetensors" in err
    # build-cache redoes just the damaged shard and gets the same bytes back
    build_cache(setup["cfg"], setup["convs"], d, target=tiny_target)
    assert _checksums(d) == _checksums(setup["ref"])

    (d / "shard-00000.safetensors").unlink()
    with pytest.raises(DeepSpecError, match="shard-00000.safetensors missing"):
        validate_cache(d)


def test_killed_build_resumes_byte_identical(setup, tiny_target, tmp_path, monkeypatch):
    d = tmp_path / "cache"
    write_shard, written = cache._write_shard, []

    def dies_after_one_shard(*args):  # a kill right after the first shard landed
        if written:
            raise RuntimeError("injected failure")
        write_shard(*args)
        written.append(1)

    monkeypatch.setattr(cache, "_write_shard", dies_after_one_shard)
    with pytest.raises(RuntimeError, match="injected failure"):
        build_cache(setup["cfg"], setup["convs"], d, target=tiny_target)
    assert not (d / "manifest.json").exists()
    assert sorted(p.name for p in d.glob("shard-*")) == ["shard-00000.safetensors"]
    first = sha256_file(d / "shard-00000.safetensors")
    monkeypatch.setattr(cache, "_write_shard", write_shard)
    build_cache(setup["cfg"], setup["convs"], d, target=tiny_target)
    assert not (d / PROGRESS).exists()
    assert sha256_file(d / "shard-00000.safetensors") == first
    assert _checksums(d) == _checksums(setup["ref"])  # shards and manifest


def test_a_reduced_draft_vocabulary_caches_the_log_normalizers(setup, tiny_target, tmp_path):
    """With drafter.draft_vocab_size the cache stores target_lse, the target's
    log-normalizer of each stored last_hidden (the cache's compute dtype), and
    online mode computes the same rows bit for bit at micro batch 1; it is another
    cache (fingerprint) than the full vocabulary's, whose samples have none. A
    manifest without the key (written before it existed) reads without it."""
    from deepspec.data.cache import cache_target
    from deepspec.settings import Settings

    cfg = {**setup["cfg"], "drafter": {**setup["cfg"]["drafter"], "draft_vocab_size": 64},
           "cache": {**setup["cfg"]["cache"], "batch_size": 1}}
    m = build_cache(cfg, setup["convs"], tmp_path / "lse", target=tiny_target)
    full = make_train_dataset(setup["cfg"], cache_dir=setup["ref"])
    data = make_train_dataset(cfg, cache_dir=tmp_path / "lse")
    assert m["target_lse"] and data.fingerprint != full.fingerprint
    assert "target_lse" not in full[0] and not json.loads((setup["ref"] / "manifest.json").read_text())["target_lse"]
    head = cache_target(Settings.of(cfg), tiny_target)  # the compute dtype (bf16 where native)
    for i in (0, 3):
        x = data[i]
        assert x["target_lse"].dtype == torch.float32 and x["target_lse"].shape == x["input_ids"].shape
        want = head.log_normalizer(x["last_hidden"].to(next(head.model.parameters()).dtype))
        torch.testing.assert_close(x["target_lse"], want, atol=1e-4, rtol=1e-5)
    online_cfg = {**cfg, "cache": {**cfg["cache"], "mode": "online"}, "train": {**cfg["train"], "micro_batch": 1}}
    online = make_train_dataset(online_cfg, tiny_target, conversations=setup["convs"])
    a, b = collate([data[2]]), train_collate(online)([online[2]])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    d = tmp_path / "old"
    shutil.copytree(setup["ref"], d)
    old = json.loads((d / "manifest.json").read_text())
    del old["target_lse"]
    (d / "manifest.json").write_text(json.dumps(old))
    assert "target_lse" not in make_train_dataset(setup["cfg"], cache_dir=d)[0]


def test_dry_run_writes_nothing(setup, tmp_path, capsys):
    d = tmp_path / "cache"
    est = build_cache(setup["cfg"], setup["convs"], d, dry_run=True)
    assert not d.exists()
    assert est["bytes_per_token"] == 4 + 1 + 3 * 64 * 2
    ref = json.loads((setup["ref"] / "manifest.json").read_text())
    assert est["tokens"] == ref["num_tokens"]
    assert f"{est['tokens']} tokens x 389 bytes/token" in capsys.readouterr().out


def test_dataset_errors(setup, tmp_path):
    with pytest.raises(DeepSpecError, match="build-cache"):
        make_train_dataset(setup["cfg"], cache_dir=tmp_path / "none")
    cfg = {**setup["cfg"], "target": {**setup["cfg"]["target"], "feature_layers": [0]}}
    with pytest.raises(DeepSpecError, match="feature_layers"):
        make_train_dataset(cfg, cache_dir=setup["ref"])


def test_collate_pads_and_masks():
    def s(n):
        return {"input_ids": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.bool),
                "features": torch.ones(n, 4), "last_hidden": torch.ones(n, 2)}

    b = collate([s(3), s(5)])
    assert b["input_ids"].shape == (2, 5) and b["features"].shape == (2, 5, 4) and b["last_hidden"].shape == (2, 5, 2)
    assert b["attention_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert b["loss_mask"][0, 3:].any().item() is False and b["features"][0, 3:].abs().sum() == 0


def test_shard_plan_is_deterministic():
    assert plan_shards([5, 5, 5, 5, 5], 10) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards([30, 1, 1], 10) == [(0, 1), (1, 3)]


def test_training_reads_only_intact_shards(setup, tmp_path):
    """Each process checks a shard's sha256 the first time it opens it: flipped
    bytes stop training with one line naming the shard."""
    import shutil

    d = tmp_path / "cache"
    shutil.copytree(setup["ref"], d)
    shard = d / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # inside a tensor: the file still parses
    shard.write_bytes(bytes(raw))
    data = make_train_dataset(setup["cfg"], cache_dir=d)
    with pytest.raises(DeepSpecError, match=r"shard-00000\.safetensors is corrupt: sha256 mismatch"):
        data[0]
    assert make_train_dataset(setup["cfg"], cache_dir=setup["ref"]).fingerprint == data.fingerprint


# The cache fingerprints of the presets' settings before CACHE_BYTES_SETTINGS named them
# (target id "target-id", token digest "abc123"): an existing cache stays valid. The
# default's (a reduced draft vocabulary) changed when its cache began to store target_lse, the
# paper presets' when they pinned their targets at hub commits (target.revision: another cache).
_FINGERPRINTS = {
    "tiny": "8d69a7867ed64202d2ab11b24fc2b53c8364391b015365d6ac74835086658197",
    "smollm2-135m": "11c7046acc5133736397d22f0cbd339ea7da89d76820a09eb018ee420ed2c858",
    "qwen3-4b": "cfa80d6750d9717e2bc539026ee9dc2375706e4e45d249cfa75812d22a55ca66",
    "gemma4-12b": "5db2fed442d61553aca91d521179061b478aec0adc69b732da7a5db0e488910a",
}


@pytest.mark.parametrize("preset", sorted(_FINGERPRINTS))
def test_cache_fingerprint_is_unchanged(preset, monkeypatch):
    """Computed in target.dtype (a CPU without native bf16: cache.precision auto is
    fp32 there), a preset's cache keeps its fingerprint; computed in another dtype
    (bf16 on an AMX machine, for an fp32 target), it is another cache."""
    from types import SimpleNamespace

    from deepspec import runtime

    cfg = load_config(preset)
    monkeypatch.setattr(runtime, "bf16_matmul_support", lambda device="cpu": (False, "test"))
    fp = cache.data_fingerprint(cfg, "target-id", SimpleNamespace(digest="abc123"))
    assert fp == _FINGERPRINTS[preset] or cfg["target"]["dtype"] != "float32"
    monkeypatch.setattr(runtime, "bf16_matmul_support", lambda device="cpu": (True, "test"))
    bf16 = cache.data_fingerprint(cfg, "target-id", SimpleNamespace(digest="abc123"))
    assert (bf16 == _FINGERPRINTS[preset]) == (cfg["target"]["dtype"] == "bfloat16")


def test_cache_fingerprint_settings_are_build_cache_settings():
    """Each setting of the cache's fingerprint reruns build_cache and changes the fingerprint."""
    from types import SimpleNamespace

    from deepspec.config import CACHE_BYTES_SETTINGS, RULE_SETTINGS, settings_fingerprint

    cfg = load_config("tiny")
    fp = cache.data_fingerprint(cfg, "t", SimpleNamespace(digest="d"))
    for path in CACHE_BYTES_SETTINGS.values():
        assert path in RULE_SETTINGS["build_cache"]
        section, key = path.split(".")
        other = {**cfg, section: {**cfg[section], key: [7] if key == "feature_layers" else "changed"}}
        assert cache.data_fingerprint(other, "t", SimpleNamespace(digest="d")) != fp, path
        assert settings_fingerprint(other, "build_cache") != settings_fingerprint(cfg, "build_cache"), path

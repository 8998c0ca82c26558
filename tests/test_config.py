import subprocess
import sys

import pytest

from deepspec.config import PRESETS_DIR, load_config
from deepspec.errors import DeepSpecError

# cost-benchmark presets that train on their own evaluation prompts at T = 0 on purpose
# (benchmarks/bench_vllm.py needs a drafter with a high tau); they reproduce nothing of the paper
BENCHMARK_ONLY = {"smollm2-135m-overfit"}
CPU_LR = {"smollm2-135m": {"eagle3": 2.4e-3, "dflash": 4.8e-3, "dspark": 2.4e-3}}
CPU_LR["smollm2-135m-full"] = CPU_LR["smollm2-135m"]


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_every_preset_validates(preset):
    cfg = load_config(preset)
    assert cfg["drafter"]["block_size"] == 7 and cfg["loss"]["decay_gamma"] == 4.0
    assert cfg["loss"]["ce_alpha"] == 0.1 and cfg["loss"]["l1_alpha"] == 0.9 and cfg["loss"]["conf_alpha"] == 1.0
    if preset in BENCHMARK_ONLY:
        assert "cost benchmarks only" in cfg["description"]
        return
    # the CPU presets' learning rate is a measured departure (docs/RESULTS.md's A/Bs, docs/FIDELITY.md);
    # every other preset keeps the paper's
    assert cfg["train"]["lr"] == CPU_LR.get(preset, 6e-4) and cfg["eval"]["temperature"] == 1.0


def test_paper_presets_keep_paper_values():
    for name, layers in [("qwen3-4b", [1, 9, 17, 25, 33]), ("qwen3-14b", [1, 10, 19, 28, 37]), ("gemma4-12b", [5, 17, 29, 41, 46])]:
        cfg = load_config(name)
        assert cfg["target"]["feature_layers"] == layers
        assert cfg["train"]["epochs"] == 10 and cfg["train"]["global_batch"] == 512
        assert cfg["data"]["max_length"] == 4096 and cfg["eval"]["max_new_tokens"] == 2048
        assert cfg["drafter"]["num_layers"] == {"eagle3": 1, "dflash": 5, "dspark": 5}
        assert sum(b["cap"] for b in cfg["data"]["benchmarks"].values()) == 3030


@pytest.mark.parametrize(
    "over,msg",
    [
        ({"train": {"lrr": 1}}, "unknown key 'train.lrr'"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ({"train": {"lr": "fast"}}, "invalid value for 'train.lr'"),
        ({"data": {"benchmarks": {"x": {"path": "a", "domain": "Poetry"}}}}, "data.benchmarks.x.domain"),
    ],
)
def test_bad_config_names_the_key(over, msg):
    # the key came from the overrides (--set / --config), which the message blames, not the preset file
    with pytest.raises(DeepSpecError, match=r"^overrides \(--set / --config\): .*" + msg.replace(".", r"\.").replace("(", r"\(")):
        load_config("tiny", over)


def test_bad_key_in_the_preset_file_blames_the_file(tmp_path):
    bad = _preset(tmp_path, "mine", "base: tiny\ntrain: {lrr: 1}\n")
    with pytest.raises(DeepSpecError, match=r"mine\.yaml: unknown key 'train\.lrr'"):
        load_config(bad, {"train": {"lr": 1e-3}})  # an override of a sibling key: still the file's fault


def test_missing_preset_file_is_named_as_a_file(tmp_path):
    for path in (str(tmp_path / "none.yaml"), str(tmp_path / "dir" / "none")):
        with pytest.raises(DeepSpecError, match=r"^preset file not found: .*none"):
            load_config(path)


@pytest.mark.parametrize("item,msg", [
    ("train.lr=.nan", r"invalid value for 'train\.lr': nan is not a finite number"),
    ("train.epochs=.inf", r"invalid value for 'train\.epochs': inf is not a finite number"),
    ("train.epochs=1e999", r"invalid value for 'train\.epochs': inf is not a finite number"),
    ("eval.temperature=-.inf", r"invalid value for 'eval\.temperature': -inf is not a finite number"),
    ("ablations.thresholds=[0.1, .nan]", r"invalid value for 'ablations\.thresholds\.1': nan is not a finite number"),
    ("target.feature_layers=[0, 0]", r"invalid value for 'target\.feature_layers': \[0, 0\] has non-unique elements"),
    ("train.methods=[]", r"invalid value for 'train\.methods': \[\] should be non-empty"),
    ("train.methods=[dspark, dspark]", r"invalid value for 'train\.methods': .* has non-unique elements"),
])
def test_meaningless_values_are_refused_naming_the_key(item, msg):
    """NaN and infinity (which JSON Schema's number admits), a feature layer
    twice, no method at all or one twice: refused when the config is read."""
    from deepspec.config import parse_set

    with pytest.raises(DeepSpecError, match=msg) as e:
        load_config("tiny", parse_set([item]))
    assert "\n" not in str(e.value)


def test_preset_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "badutf8.yaml"
    bad.write_bytes(b"\xff\xfebase: tiny\n")
    with pytest.raises(DeepSpecError, match=r"badutf8\.yaml: not UTF-8 text \(byte 0") as e:
        load_config(str(bad))
    assert "\n" not in str(e.value)


def test_unknown_preset():
    with pytest.raises(DeepSpecError, match="unknown preset"):
        load_config("nope")


def _preset(d, name, text):
    (d / f"{name}.yaml").write_text(text)
    return str(d / f"{name}.yaml")


def test_base_preset_is_deep_merged_under_the_file(tmp_path):
    """`base:` (a preset name or path): the base's keys under this file's, nested
    mappings merged key by key, lists and nulls replaced."""
    paper = load_config("qwen3-4b")
    mid = _preset(tmp_path, "mid", "base: qwen3-4b\ntrain: {epochs: 1}\ndata: {benchmarks: {gsm8k: {cap: 3}}}\n")
    top = _preset(tmp_path, "top", f"base: {tmp_path / 'mid.yaml'}\n" "target: {feature_layers: [0, 1]}\nplan: {train_prompts: null}\n")
    cfg = load_config(top, {"train": {"lr": 1e-3}})
    assert cfg["preset"] == "top" and "base" not in cfg
    assert cfg["train"]["epochs"] == 1 and cfg["train"]["global_batch"] == paper["train"]["global_batch"]
    assert cfg["train"]["lr"] == 1e-3
    assert cfg["data"]["benchmarks"]["gsm8k"] == dict(paper["data"]["benchmarks"]["gsm8k"], cap=3)
    assert cfg["data"]["benchmarks"]["math500"] == paper["data"]["benchmarks"]["math500"]
    assert cfg["target"]["feature_layers"] == [0, 1] and cfg["target"]["spec"] == paper["target"]["spec"]
    assert cfg["plan"]["train_prompts"] is None and cfg["plan"]["answer_tokens"] == paper["plan"]["answer_tokens"]
    assert load_config(mid)["target"]["feature_layers"] == paper["target"]["feature_layers"]


def test_hub_targets_are_pinned_at_commits_of_their_own_repository(tmp_path):
    """Every preset whose target is a hub id pins it at a commit (a branch moves
    under a rerun), one commit per repository; a builtin target has none, and a
    preset or override that names another spec drops the revision beneath it."""
    import re

    from deepspec.targets.loading import BUILTIN

    commits = {}
    for p in sorted(PRESETS_DIR.glob("*.yaml")):
        t = load_config(p.stem)["target"]
        if t["spec"] in BUILTIN:
            assert t["revision"] is None, p.stem
            continue
        assert re.fullmatch(r"[0-9a-f]{40}", t["revision"] or ""), (p.stem, t["revision"])
        commits.setdefault(t["revision"], set()).add(t["spec"])
    assert len(commits) >= 4 and all(len(specs) == 1 for specs in commits.values()), commits
    paper = load_config("qwen3-4b")["target"]
    mine = _preset(tmp_path, "mine", "base: qwen3-4b\ntarget: {spec: Qwen/Qwen3-1.7B}\n")
    assert load_config(mine)["target"]["revision"] is None
    assert load_config("qwen3-4b", {"target": {"spec": "Qwen/Qwen3-1.7B"}})["target"]["revision"] is None
    assert load_config("qwen3-4b", {"target": {"spec": "Qwen/Qwen3-1.7B", "revision": "v1"}})["target"]["revision"] == "v1"
    same = _preset(tmp_path, "same", f"base: qwen3-4b\ntarget: {{spec: {paper['spec']}}}\n")
    assert load_config(same)["target"]["revision"] == paper["revision"]


def test_bad_base_is_one_line(tmp_path):
    cases = {
        "unknown": ("base: qwen3-4bb\n", r"unknown\.yaml: base: unknown preset 'qwen3-4bb' \(known: .*qwen3-4b"),
        "self": (f"base: {tmp_path / 'self.yaml'}\n", r"base presets form a cycle \(self -> self\)"),
        "a": (f"base: {tmp_path / 'b.yaml'}\n", r"base presets form a cycle \(a -> b -> a\)"),
        "b": (f"base: {tmp_path / 'a.yaml'}\n", None),
        "notname": ("base: [qwen3-4b]\n", r"invalid value for 'base'"),
    }
    paths = {name: _preset(tmp_path, name, text) for name, (text, _) in cases.items()}
    for name, (_, msg) in cases.items():
        if msg:
            with pytest.raises(DeepSpecError, match=msg) as e:
                load_config(paths[name])
            assert "\n" not in str(e.value)
    with pytest.raises(DeepSpecError, match="override 'base'"):
        load_config("tiny", {"base": "qwen3-4b"})


def test_cli_error_is_one_line():
    r = subprocess.run([sys.executable, "-m", "deepspec", "show-config", "--preset", "tiny", "--set", "eval.temprature=1"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown key 'eval.temprature'" in r.stderr


# --------------------------------------------------------------------------- overrides


def test_yaml_12_numbers_and_booleans():
    from deepspec.config import coerce_overrides, parse_set

    assert parse_set(["train.lr=3e-4", "eval.n_boot=5", "drafter.init_from_target=true", "target.revision=yes"]) == {
        "train": {"lr": 3e-4}, "eval": {"n_boot": 5}, "drafter": {"init_from_target": True}, "target": {"revision": "yes"}}
    # Snakemake's --config hands `{epochs: 2}` and `true` over as text
    assert coerce_overrides({"train": "{epochs: 2, lr: 3e-4}", "x": {"y": "false", "z": "tiny"}}) == {
        "train": {"epochs": 2, "lr": 3e-4}, "x": {"y": False, "z": "tiny"}}
    with pytest.raises(DeepSpecError, match="malformed YAML value"):
        parse_set(["train={lr: [1, 2}"])


def _readme_overrides():
    """Every `--config k=v ...` and `--set k=v` example of the README and of `--help`."""
    import argparse
    import re
    import shlex
    from pathlib import Path

    from deepspec.config import add_config_args

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    p = argparse.ArgumentParser()
    add_config_args(p)
    text += p.format_help()
    out = []
    for m in re.finditer(r"--config ([^`\n#]+)", text):
        out += [("config", kv) for kv in shlex.split(m.group(1)) if "=" in kv]
    out += [("set", m.group(1)) for m in re.finditer(r"--set ([\w.]+=[^\s`\]]+)", text)]
    return [(k, kv) for k, kv in out if not kv.split("=")[0].isupper() and kv.split("=")[1] != "NAME"]  # placeholders


@pytest.mark.parametrize("kind,item", _readme_overrides(), ids=lambda x: str(x))
def test_every_documented_override_works(kind, item):
    from deepspec.config import coerce_overrides, parse_set

    if kind == "set":
        over = parse_set([item])
    else:  # as Snakemake parses --config: a string value after key=
        key, value = item.split("=", 1)
        over = coerce_overrides({key: value})
    preset = over.pop("preset", "tiny") if isinstance(over.get("preset"), str) else "tiny"
    load_config(preset, over)


def test_readme_has_override_examples():
    kinds = {k for k, _ in _readme_overrides()}
    assert kinds == {"config", "set"} and len(_readme_overrides()) >= 4


# --------------------------------------------------------------------------- RULE_SETTINGS paths


def _schema_misses(paths) -> list:
    """The dotted paths that workflow/schemas/config.schema.yaml does not have
    (walked here independently of deepspec.config)."""
    import yaml

    from deepspec.config import SCHEMA_PATH

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    misses = []
    for path in paths:
        node = schema
        for part in path.split("."):
            node = node.get("properties", {}).get(part)
            if node is None:
                misses.append(path)
                break
    return sorted(misses)


def _setting_paths():
    from deepspec import config as C

    return {p for keys in C.RULE_SETTINGS.values() for p in keys} | set(C.EXECUTION_KEYS)


def test_every_rule_setting_and_execution_key_is_in_the_schema(monkeypatch):
    from deepspec import config as C

    assert _schema_misses(_setting_paths()) == []
    assert C.unknown_setting_paths() == []
    # a typo is caught, by this test and by the config module
    monkeypatch.setitem(C.RULE_SETTINGS, "train", [*C.RULE_SETTINGS["train"], "train.learning_rate"])
    monkeypatch.setattr(C, "EXECUTION_KEYS", C.EXECUTION_KEYS | {"eval.gpu"})
    assert _schema_misses(_setting_paths()) == ["eval.gpu", "train.learning_rate"]
    assert C.unknown_setting_paths() == ["eval.gpu", "train.learning_rate"]


@pytest.mark.parametrize("where", ["rule", "execution"])
def test_a_misspelled_setting_path_stops_the_fingerprint(monkeypatch, where):
    """A misspelled path used to fingerprint None (the setting never reran its rule)."""
    from deepspec import config as C

    cfg = load_config("tiny")
    if where == "rule":
        monkeypatch.setitem(C.RULE_SETTINGS, "build_cache", [*C.RULE_SETTINGS["build_cache"], "cache.shard_token"])
        typo = "cache.shard_token"
    else:
        monkeypatch.setattr(C, "EXECUTION_KEYS", C.EXECUTION_KEYS | {"train.checkpoint_evry"})
        typo = "train.checkpoint_evry"
    with pytest.raises(DeepSpecError, match=typo):
        C.settings_fingerprint(cfg, "build_cache")


def test_only_optional_keys_without_default_may_be_absent():
    """data.benchmarks is optional without a default: absent, it reads as None.
    target.revision has a default, so a config lacking it was not validated."""
    from deepspec.config import pick, settings_fingerprint

    cfg = load_config("tiny")
    del cfg["data"]["benchmarks"]
    assert pick(cfg, "data.benchmarks") is None and pick(cfg, "data.train") == cfg["data"]["train"]
    assert settings_fingerprint(cfg, "baseline")
    del cfg["target"]["revision"]
    with pytest.raises(DeepSpecError, match="'target.revision' is missing"):
        pick(cfg, "target.revision")
    with pytest.raises(DeepSpecError, match="'target.revison' is not in config.schema.yaml"):
        pick(cfg, "target.revison")


def test_per_method_learning_rates_resolve_for_each_method_and_its_variants():
    """train.lr as a mapping: each method (and its ablation variants) trains at its own
    rate, a method not named at the paper's 6e-4; a non-positive rate is refused."""
    from deepspec.errors import DeepSpecError
    from deepspec.methods import resolve_method

    cfg = load_config("tiny", {"train": {"lr": {"eagle3": 2.4e-3, "dspark": 4.8e-3}}})
    got = {m: resolve_method(cfg, m)[1]["train"]["lr"] for m in ("eagle3", "dspark", "dspark-l1", "dspark_rnn", "dflash")}
    assert got == {"eagle3": 2.4e-3, "dspark": 4.8e-3, "dspark-l1": 4.8e-3, "dspark_rnn": 4.8e-3, "dflash": 6e-4}
    assert resolve_method(load_config("tiny", {"train": {"lr": 1e-3}}), "dflash")[1]["train"]["lr"] == 1e-3
    with pytest.raises(DeepSpecError, match="train.lr"):
        load_config("tiny", {"train": {"lr": {"dspark": 0}}})


def test_a_key_given_twice_in_a_preset_is_refused(tmp_path):
    """C7: two `base:` keys (or any key twice in one mapping) fail in one line naming
    the file and both lines, instead of the last one winning without a word."""
    p = tmp_path / "twice.yaml"
    p.write_text("base: tiny\ndescription: x\nbase: smollm2-135m\n")
    with pytest.raises(DeepSpecError, match=r"twice\.yaml: malformed YAML: duplicate key 'base' \(line 1 and line 3\)$"):
        load_config(str(p))
    p.write_text("base: tiny\ntrain:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(DeepSpecError, match=r"duplicate key 'lr' \(line 3 and line 4\)"):
        load_config(str(p))


def test_the_cpu_matmul_kernels_are_part_of_the_decoding_rules_settings():
    """C8: target.cpu_matmul changes the records (kernels round differently), so the rules
    that decode rerun when it changes. Regeneration too: its local backend samples a
    bf16 target inside `prepacked_linears` (regeneration/local.py:sampling_kernels), which
    packs the target's weights for oneDNN only with cpu_matmul onednn, so the sampled
    tokens can differ between the two settings. The rules that run no CPU decoding
    forward (the cache's features and training run with gradients or torch's kernels
    only) do not rerun, and no rule but these lists the key."""
    from deepspec import config as C

    cfg = load_config("tiny")
    other = load_config("tiny", {"target": {"cpu_matmul": "torch" if cfg["target"]["cpu_matmul"] != "torch" else "onednn"}})
    decoding = {"evaluate", "baseline", "throughput", "serve_check", "regenerate"}
    for rule in decoding:
        assert C.settings_fingerprint(cfg, rule) != C.settings_fingerprint(other, rule), rule
    for rule in set(C.RULE_SETTINGS) - decoding - {"report"}:  # (report: the whole target section)
        assert C.settings_fingerprint(cfg, rule) == C.settings_fingerprint(other, rule), rule
    assert {r for r, keys in C.RULE_SETTINGS.items() if "target.cpu_matmul" in keys} == decoding


def test_regeneration_samples_a_bf16_target_through_the_cpu_matmul_setting(tiny_target, monkeypatch):
    """The fact the regenerate rule's settings rest on: `sampling_kernels` enters
    `prepacked_linears` for a bf16 target, and that context packs the weights exactly
    when target.cpu_matmul is onednn (`Target.packed_matmuls`)."""
    import contextlib

    import torch

    from deepspec.core import target as T
    from deepspec.regeneration import local

    entered = []
    monkeypatch.setattr(T, "prepacked_linears", lambda t: entered.append(t) or contextlib.nullcontext())
    bf16 = type("BF16Target", (), {"lm_head": torch.nn.Linear(2, 2, dtype=torch.bfloat16)})()
    with local.sampling_kernels(bf16):
        pass
    with local.sampling_kernels(type("FP32Target", (), {"lm_head": torch.nn.Linear(2, 2)})()):
        pass
    assert entered == [bf16]
    monkeypatch.undo()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch: prepacked_linears packs nothing either way")
    for packed in (True, False):  # the flag target_from_config sets from target.cpu_matmul
        monkeypatch.setattr(tiny_target, "packed_matmuls", packed)
        with torch.no_grad(), T.prepacked_linears(tiny_target):
            patched = any("forward" in m.__dict__ for m in tiny_target.model.modules() if isinstance(m, torch.nn.Linear))
        assert patched == packed

"""Plan-time checks (deepspec/planning/preflight.py): a preset that cannot work
stops with one line before any job runs."""
import pytest

from deepspec.config import load_config
from deepspec.errors import DeepSpecError
from deepspec.planning.preflight import preflight


@pytest.mark.parametrize("over,msg", [
    ({"train": {"methods": ["eagle3", "medusa"]}}, "unknown method 'medusa'"),
    ({"train": {"micro_batch": 3}}, r"global_batch \(4\) must be a multiple of train.micro_batch \(3\)"),
    ({"target": {"feature_layers": [0, 1]}}, "layer 1 is out of range for the 2-layer target"),
    ({"target": {"feature_layers": [-2]}}, "minimum of -1"),
    ({"eval": {"speed_benchmarks": ["gsm8k", "mbpp"]}}, "eval.speed_benchmarks: 'mbpp' is not a benchmark of this preset"),
    ({"eval": {"released_checkpoints": {"dflash": "released/none"}}},
     "eval.released_checkpoints.dflash: no directory 'released/none' here"),
])
def test_preflight_stops_at_plan_time(over, msg):
    with pytest.raises(DeepSpecError, match=msg):
        preflight(load_config("tiny", over))


def test_eval_needs_two_new_tokens():
    with pytest.raises(DeepSpecError, match="eval.max_new_tokens"):
        load_config("tiny", {"eval": {"max_new_tokens": 1}})


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m", "smollm2-135m-full", "qwen3-4b", "gemma4-12b",
                                    "rehearsal-qwen3", "rehearsal-gemma4"])
def test_presets_pass_preflight(preset):
    """Every preset the README lists runs as it is: none needs a file only a test writes."""
    preflight(load_config(preset))


def test_show_config_makes_the_dags_checks(tmp_path):
    """show-config prints the preset as the run sees it, so it refuses what planning the DAG
    refuses, in one line; a released checkpoint that is a local directory must exist."""
    import subprocess
    import sys

    def show(*sets, cwd=None):
        args = [a for kv in sets for a in ("--set", kv)]
        return subprocess.run([sys.executable, "-m", "deepspec", "show-config", "--preset", "tiny", *args],
                              capture_output=True, text=True, cwd=cwd)

    for kv, msg in [("train.methods=[eagle3, foo]", "unknown method 'foo'"),
                    ("eval.speed_benchmarks=[nope]", "'nope' is not a benchmark of this preset"),
                    ("eval.released_checkpoints.dflash=rel/dflash", "no directory 'rel/dflash' here")]:
        r = show(kv, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and msg in r.stderr, (kv, r.stderr)
    (tmp_path / "rel" / "dflash").mkdir(parents=True)
    r = show("eval.released_checkpoints.dflash=rel/dflash", cwd=tmp_path)
    assert r.returncode == 0 and '"dflash": "rel/dflash"' in r.stdout, r.stderr


@pytest.mark.parametrize("preset", ["qwen3-4b", "gemma4-12b"])
def test_one_reader_of_the_target_dimensions(preset, tmp_path):
    """preflight's depth, the cache estimate's hidden size and plan's facts come
    from one reader (targets.specs.text_dims), offline, without the target."""
    from deepspec.data.cache import _hidden_size
    from deepspec.planning.preflight import target_num_layers
    from deepspec.targets.specs import load_facts, text_dims

    cfg = load_config(preset, {"resources_dir": str(tmp_path)})  # no prepared target there
    facts, _ = load_facts(cfg)
    text = facts.get("text_config") or facts
    assert text_dims(cfg) == text and text["num_hidden_layers"] > 20
    assert target_num_layers(cfg) == text["num_hidden_layers"]
    assert _hidden_size(cfg) == text["hidden_size"]  # was read from the hub


def test_batch_divisibility_is_one_check():
    from deepspec.training.recipe import accumulation_steps

    cfg = load_config("tiny", {"train": {"global_batch": 6, "micro_batch": 4}})
    with pytest.raises(DeepSpecError) as a:
        preflight(cfg)
    with pytest.raises(DeepSpecError) as b:
        accumulation_steps(cfg["train"], 1)
    assert str(a.value) == str(b.value) == ("train.global_batch (6) must be a multiple of train.micro_batch (4) "
                                            "x processes (1)")

import subprocess
import sys

import pytest

from deepspec.config import PRESETS_DIR, load_config
from deepspec.errors import DeepSpecError


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_every_preset_validates(preset):
    cfg = load_config(preset)
    assert cfg["drafter"]["block_size"] == 7 and cfg["loss"]["decay_gamma"] == 4.0
    assert cfg["loss"]["ce_alpha"] == 0.1 and cfg["loss"]["l1_alpha"] == 0.9 and cfg["loss"]["conf_alpha"] == 1.0
    assert cfg["train"]["lr"] == 6e-4 and cfg["eval"]["temperature"] == 1.0


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
    with pytest.raises(DeepSpecError, match=msg.replace(".", r"\.").replace("(", r"\(")):
        load_config("tiny", over)


def test_unknown_preset():
    with pytest.raises(DeepSpecError, match="unknown preset"):
        load_config("nope")


def test_cli_error_is_one_line():
    r = subprocess.run([sys.executable, "-m", "deepspec", "show-config", "--preset", "tiny", "--set", "eval.temprature=1"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown key 'eval.temprature'" in r.stderr

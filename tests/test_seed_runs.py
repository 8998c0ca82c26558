"""The seed benchmark (benchmarks/seed_runs.py): each run sets every seed of the
preset and keeps its own results, figures and logs."""
import importlib.util
from pathlib import Path

from deepspec.config import load_config
from deepspec.paths import RunPaths

SPEC = importlib.util.spec_from_file_location("seed_runs", Path(__file__).parents[1] / "benchmarks" / "seed_runs.py")
S = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(S)


def test_a_seed_sets_every_seed_and_its_own_folders(tmp_path):
    base = load_config("smollm2-135m")
    cfg = load_config("smollm2-135m", S.overrides("7", tmp_path / "seed-7"))
    for section in ("data", "regenerate", "train", "eval"):
        assert cfg[section]["seed"] == 7 != base[section]["seed"], section
    paths = RunPaths.of(cfg)
    assert paths.run == tmp_path / "seed-7" / "results" / "smollm2-135m"
    assert paths.log("report").parent == tmp_path / "seed-7" / "logs" / "smollm2-135m"
    assert cfg["figures_dir"] == str(tmp_path / "seed-7" / "figures")
    own = load_config("smollm2-135m", S.overrides("preset", tmp_path / "seed-preset"))
    assert all(own[s]["seed"] == base[s]["seed"] for s in S.SEEDED)
    assert S.snakemake_args("smollm2-135m", S.overrides("7", tmp_path))[-1] == 'eval={"seed": 7}'


def test_the_table_counts_the_runs_where_each_claim_holds():
    rows = [{"seed": "preset", "wall_s": 900.0, "decay": "holds", "tau": "holds"},
            {"seed": "1", "wall_s": 960.0, "decay": "does not hold", "tau": "holds"},
            {"seed": "2", "wall_s": 990.0, "decay": "not judged", "tau": "holds"}]
    md = S.table(rows, ["decay", "tau"]).splitlines()
    assert md[2] == "| preset | 15.0 min | holds | holds |"
    assert md[-1] == "| runs where it holds | | 1 of 3 | 3 of 3 |"

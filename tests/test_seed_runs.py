"""The seed benchmark (benchmarks/seed_runs.py): each run sets every seed of the
preset and keeps its own results, figures and logs."""
import csv
import importlib.util
import json
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


class FakeSnakemake:
    """subprocess.run for seed_runs: a dry run answers `todo`; a run writes REPORT.md,
    or fails for the seeds in `fail`."""

    def __init__(self, todo=True, fail=()):
        self.todo, self.fail, self.runs = todo, set(fail), []

    def __call__(self, cmd, cwd=None, **kw):
        out = Path(next(a for a in cmd if a.endswith("fig2.pdf"))).parents[1]
        if "--dry-run" in cmd:
            return type("R", (), {"returncode": 0, "stdout": "" if self.todo else "Nothing to be done.", "stderr": ""})
        self.runs.append(out.name)
        if out.name.removeprefix("seed-") in self.fail:
            return type("R", (), {"returncode": 1})
        (out / "results").mkdir(parents=True, exist_ok=True)
        (out / "results" / "REPORT.md").write_text("report")
        return type("R", (), {"returncode": 0})


def test_a_recorded_run_is_reused_only_while_snakemake_finds_it_up_to_date(tmp_path, monkeypatch):
    run = tmp_path / "seed-1"
    fake = FakeSnakemake()
    monkeypatch.setattr(S.subprocess, "run", fake)
    first = S.run_dag("smollm2-135m", "1", run, "2")
    assert fake.runs == ["seed-1"] and first["whole"] is True  # from nothing: the whole run's time

    fake.todo = False  # up to date: the recorded time, no run
    assert S.run_dag("smollm2-135m", "1", run, "2") == first and fake.runs == ["seed-1"]

    fake.todo = True  # the preset or the code changed: Snakemake reruns part of it
    again = S.run_dag("smollm2-135m", "1", run, "2")
    assert fake.runs == ["seed-1", "seed-1"] and again["whole"] is False
    assert json.loads((run / "wall.json").read_text())["whole"] is False
    assert "(resumed: its last part only)" in S.table([{"seed": "1", **again}], [])


def test_a_failed_seed_is_reported_and_the_others_still_tabulated(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(S.subprocess, "run", FakeSnakemake(fail={"1"}))
    claim = type("C", (), {"name": "decay", "holds": True, "text": "decay holds"})
    monkeypatch.setattr(S, "judge", lambda preset, seed, run: [claim])
    rc = S.main(["--preset", "smollm2-135m", "--seeds", "1", "2", "--out", str(tmp_path)])
    assert rc == 1
    assert "seed 1 failed" in capsys.readouterr().err
    md = (tmp_path / "seeds.md").read_text()
    assert "| 2 |" in md and "| 1 |" not in md and "seed 1 failed" in md
    assert [r["seed"] for r in csv.DictReader(open(tmp_path / "seeds.csv"))] == ["2"]

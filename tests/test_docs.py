"""Every command the README and docs/ show in their ```bash blocks works as written.

* `python -m deepspec <command> ...`: the command exists and its own argument
  parser accepts the documented arguments; `--preset` and `--set` then load as
  a config. The command's work never runs (the parser's result stops it).
* `snakemake ...`: the README's lines are dry-run by tests/test_workflow.py; a
  line in docs/ must be one of them.
* `pip install ...`: extras exist in pyproject.toml, any other requirement is
  the one `.ci/run` installs; the README's install-and-test line is `.ci/run`'s.
* `python benchmarks/<script>.py ...`: the script exists and defines each flag.
* The README's ```python block runs on tables with the report's columns.
The README shows nothing else, so every command in it is checked.
"""
import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest
import tomllib

from deepspec.cli import COMMANDS
from deepspec.config import config_from_args

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
CI_LINE = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("pip install")][0]


def _commands(path: Path):
    """(path:line, argv) of every command in the file's ```bash blocks: lines are
    split at `&&`, comments dropped, leading VAR=value assignments removed."""
    out, in_bash = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if not in_bash or not line.split(" #")[0].strip():
            continue
        for part in line.split(" #")[0].split("&&"):
            argv = shlex.split(part)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv.pop(0)
            out.append((f"{path.relative_to(REPO)}:{n}", argv))
    return out


ALL = [c for doc in DOCS for c in _commands(doc)]


def _of(prefix):
    k = len(prefix)
    return [pytest.param(argv[k:], id=where) for where, argv in ALL if argv[:k] == prefix]


def test_readme_shows_only_checked_commands():
    kinds = (["python", "-m", "deepspec"], ["snakemake"], ["pip", "install"], ["python", "-m", "pytest"])
    other = [f"{w}: {' '.join(a)}" for w, a in _commands(README) if not any(a[:len(k)] == k for k in kinds)]
    assert not other, other
    assert len(_commands(README)) >= 10


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("argv", _of(["python", "-m", "deepspec"]))
def test_documented_deepspec_command_parses(monkeypatch, argv):
    name, rest = argv[0], argv[1:]
    assert name in COMMANDS, f"no command {name!r} (python -m deepspec --help lists them)"
    real = argparse.ArgumentParser.parse_args
    parsed = {}

    def parse_then_stop(self, args=None, namespace=None):
        parsed["ns"] = real(self, args, namespace)  # an unknown or malformed argument exits here
        known = {s for action in self._actions for s in action.option_strings}
        flags = [a.split("=")[0] for a in (args[:args.index("--")] if "--" in args else args) if a.startswith("--")]
        assert set(flags) <= known, f"abbreviated options {set(flags) - known}: spell them out"
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module, _, function = COMMANDS[name][0].partition(":")
    fn = getattr(importlib.import_module(module), function)
    with pytest.raises(_Parsed):
        fn(rest)
    ns = parsed["ns"]
    if hasattr(ns, "preset") and hasattr(ns, "overrides"):
        config_from_args(ns)  # the preset exists and the --set keys are valid


def test_docs_snakemake_lines_are_the_readmes():
    readme = {" ".join(a) for _, a in _commands(README) if a[:1] == ["snakemake"]}
    docs = [(where, argv) for where, argv in ALL if argv[:1] == ["snakemake"] and not where.startswith("README")]
    assert readme and len(docs) >= 3, "the README's and docs/' snakemake lines are no longer found"
    for where, argv in docs:
        assert " ".join(argv) in readme, f"{where}: not among the README's dry-run commands"


@pytest.mark.parametrize("argv", _of(["pip", "install"]))
def test_documented_pip_install(argv):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci = shlex.split(CI_LINE.replace("&&", " "))
    for arg in argv:
        if arg.startswith("-"):
            continue
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if m:
            missing = set((m.group(1) or "").split(",")) - set(extras) - {""}
            assert not missing, f"no extra {missing} in pyproject.toml"
        else:
            assert arg in ci, f"{arg}: not what .ci/run installs"


def test_readme_test_command_is_ci():
    assert "python -m pytest -q -n 2 --dist loadfile" in CI_LINE
    assert CI_LINE.replace("pip install -q ", "pip install ") in README.read_text(), \
        "the README's install-and-test line is not .ci/run's"


BENCHMARKS = [pytest.param(a[1:], id=w) for w, a in ALL if a[:1] == ["python"] and a[1:2] != ["-m"]]


@pytest.mark.parametrize("argv", BENCHMARKS)
def test_documented_benchmark_flags(argv):
    script = REPO / argv[0]
    assert script.parent.name == "benchmarks" and script.is_file(), argv[0]
    src = script.read_text()
    for flag in (a.split("=")[0] for a in argv[1:] if a.startswith("--")):
        assert f'"{flag}"' in src, f"{argv[0]} has no {flag}"


def test_readme_python_snippet_reads_the_report_tables(tmp_path, monkeypatch):
    """The README's pandas lines run on tables with the report's own columns."""
    import pandas as pd

    from deepspec.reporting.report import FIG2_COLUMNS, FIG2_RB_COLUMNS, TABLE1_COLUMNS

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    tables = tmp_path / "results" / "tables"
    tables.mkdir(parents=True)
    rows = [dict(zip(TABLE1_COLUMNS, ["t", m, "gsm8k", "Math", 1, 1, 1.5, 1, 2, 0.5, 1.0, 1.0])) for m in ("dflash", "dspark")]
    pd.DataFrame(rows, columns=TABLE1_COLUMNS + ["tau_selfcheck", "skipped_prompts"]).to_csv(tables / "table1.csv")
    cols = FIG2_COLUMNS + FIG2_RB_COLUMNS
    rows = [dict.fromkeys(cols, 0.5) | {"target": "t", "method": "dspark", "domain": "Math", "position": k} for k in (1, 2)]
    pd.DataFrame(rows, columns=cols).to_csv(tables / "fig2.csv")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})

"""The code's shape: the package's layers in the DAG's order (the paper's math
and models at the bottom, each pipeline stage above the stages it reads), no
import cycles, no private names across modules, short functions, and a README
map of the paper whose every entry exists."""
import ast
import importlib
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "deepspec"
README = PKG.parent / "README.md"
# The floors, lowest first: a partial order. A module imports from its own area
# and from lower floors only; areas that share a floor (the DAG's sibling stages:
# regeneration, training and evaluation all read data/) never import each other,
# except the ground's one-file modules, whose order the cycle check keeps.
# core/ and drafters/ take tensors (and drafters the typed drafter settings): no
# config dicts, files, paths or CLI.
LAYERS = [
    ("errors",),
    ("core", "architectures", "settings"),
    ("drafters",),
    ("paths", "files", "runtime", "methods", "config", "provenance", "checkout", "fetch", "gpus",
     "vllm_env", "paper"),
    ("targets",),
    ("data", "formats"),
    ("regeneration", "training", "evaluation"),
    ("serving", "reporting"),
    ("planning",),
    ("workflow", "cli", "__main__"),
]
LAYER = {area: i for i, areas in enumerate(LAYERS) for area in areas}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts), parts[-1] == "__init__"


def _area(module: str) -> str:
    """The subpackage (core, drafters, data, ...) or the top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved,
    function-level imports included)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names)  # `from . import x` imports module x
    return out


def _own(name: str) -> bool:
    return name == "deepspec" or name.startswith("deepspec.")


def _graph() -> dict[str, set[str]]:
    """module -> the deepspec modules it imports (resolved to modules, not names)."""
    mods = {m: (p, pkg) for p, m, pkg in _modules()}
    out = {}
    for m, (p, pkg) in mods.items():
        deps = set()
        for n in _imports(p, m, pkg):
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != m and n != "deepspec":
                deps.add(n)
        out[m] = deps
    return out


def test_every_module_has_a_layer():
    missing = sorted({_area(m) for _, m, _ in _modules() if m != "deepspec"} - set(LAYER))
    assert not missing, f"add {missing} to LAYERS"


def _allowed(m: str, d: str) -> bool:
    """May module m import module d? Its own area, a lower floor, or (on one floor)
    two one-file modules of the ground."""
    a, b = _area(m), _area(d)
    if a == b or LAYER[b] < LAYER[a]:
        return True
    return LAYER[a] == LAYER[b] and not _is_package(a) and not _is_package(b)


def _is_package(area: str) -> bool:
    return (PKG / area).is_dir()


def test_layers_point_down():
    """A stage imports only itself and the floors below it (function-level
    imports included), and no sibling stage of its floor, so the folders tell
    the data's way through the DAG."""
    bad = [f"{m} ({_area(m)}) imports {d} ({_area(d)})"
           for m, deps in _graph().items() if m != "deepspec"
           for d in sorted(deps) if not _allowed(m, d)]
    assert not bad, bad


def test_no_import_cycles():
    graph = _graph()
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_private_names_across_modules():
    """`from x import _name` only inside one module's own package-private
    helpers is a smell; a name shared between modules is public."""
    bad = []
    for path, module, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{module}: from {'.' * node.level}{node.module or ''} import {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_the_import_walker_sees_relative_and_late_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from ..data.cache import x\ndef f():\n    from ..paths import RunPaths\n")
    names = _imports(f, "deepspec.core.m", False)
    assert "deepspec.data.cache" in names and "deepspec.paths" in names


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ..training.loop import train\n")
    deps = {n for n in _imports(f, "deepspec.data.m", False) if _own(n)}
    assert any(not _allowed("deepspec.data.m", d) for d in deps)


def test_the_layer_check_catches_a_sibling_import():
    """Siblings share a floor and stand apart: evaluation may not read training."""
    assert not _allowed("deepspec.evaluation.m", "deepspec.training.loop")
    assert _allowed("deepspec.reporting.m", "deepspec.training.loop")
    assert _allowed("deepspec.fetch", "deepspec.files")


def test_functions_are_short():
    """No function over 60 lines in core/ and drafters/, none over 80 anywhere."""
    long = []
    for path, module, _ in _modules():
        limit = 60 if _area(module) in ("core", "drafters") else 80
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{module}.{node.name}: {n} lines (limit {limit})")
    assert not long, long


def test_modules_are_short():
    """No module of the package over 500 lines: a longer one holds several concepts."""
    long = [f"{module}: {n} lines" for path, module, _ in _modules()
            if (n := len(path.read_text().splitlines())) > 500]
    assert not long, long


def test_the_readme_is_short():
    """The README is a user's document of at most 300 lines; the rest is in docs/."""
    assert len(README.read_text().splitlines()) <= 300


def _readme_map():
    """(concept, module, name) rows of the README's "Where the paper lives" table."""
    text = README.read_text()
    section = text.split("## Where the paper lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        for m in re.finditer(r"`deepspec/([\w/]+)\.py:([\w.]+)`", line):
            rows.append((line.split("|")[1].strip(), "deepspec." + m.group(1).replace("/", "."), m.group(2)))
    return rows


def test_readme_maps_the_paper():
    rows = _readme_map()
    assert len(rows) >= 25
    concepts = " ".join(c for c, _, _ in rows)
    for must in ("Eq. 2", "Eq. 5", "Eq. 7", "Eq. 8", "Eq. 12", "Algorithm 1", "Figure 2", "STS", "Table 1"):
        assert must in concepts, must


@pytest.mark.parametrize("concept,module,name", _readme_map())
def test_readme_map_entry_exists(concept, module, name):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)


def test_every_command_names_a_function_that_exists():
    """cli.COMMANDS names each command's function ("module:cli_x"), so grep finds it."""
    from deepspec.cli import COMMANDS

    for command, (target, _) in COMMANDS.items():
        module, fn = target.split(":")
        path = PKG.parent / (module.replace(".", "/") + ".py")
        defs = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert fn in defs, f"{command}: {target} does not exist"


# ----------------------------------------------------------------------------- names in prose
# Module names, paths and `module.name` references in docstrings, comments, the README,
# docs/, the rule files and benchmarks/ name what exists (a stale one fails here).
REPO = PKG.parent
PROSE = [*sorted(PKG.rglob("*.py")), README, *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "workflow" / "rules").glob("*.smk")), REPO / "Snakefile", *sorted((REPO / "benchmarks").glob("*.py"))]
MODULES = {m: p for p, m, _ in _modules()}
SECTIONS = {"target", "data", "regenerate", "cache", "drafter", "loss", "train", "eval", "serve", "throughput",
            "ablations", "plan", "resources"}  # `train.lr` is a setting, not module train
UPSTREAM = {"eval", "modeling", "trainer"}  # deepspec/<these>/...: DeepSeek's DeepSpec repository, the reference
EXTENSIONS = {"py", "csv", "json", "jsonl", "md", "yaml", "pdf", "png", "txt", "rst", "html", "safetensors", "log"}


def _defined(path: Path) -> set[str]:
    """Every name a module defines: functions, classes, methods, assignments, instance attributes, imports."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            out.update(t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name))
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "self":
            out.add(n.attr)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def _dotted_exists(ref: str) -> bool:
    """deepspec.a.b[.name]: the longest module prefix exists and defines the rest's first name."""
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if module in MODULES:
            return k == len(parts) or parts[k] in _defined(MODULES[module])
    return False


def _path_exists(path: str, name: str | None) -> bool:
    for base in (REPO, PKG):
        if (base / path).is_file():
            return not name or not path.endswith(".py") or name.split(".")[0] in _defined(base / path)
    return False


def _stale_names(line: str) -> list[str]:
    bad = [m.group(0) for m in re.finditer(r"\bdeepspec(?:\.[A-Za-z_]\w*)+", line) if not _dotted_exists(m.group(0))]
    for m in re.finditer(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)(?::([A-Za-z_][\w.]*))?", line):
        top = m.group(1).split("/")
        if top[0] == "deepspec" and top[1] in UPSTREAM:
            continue  # DeepSeek's DeepSpec repository
        ours = top[0] in ("deepspec", "tests", "benchmarks", "workflow") or (PKG / top[0]).exists()
        if ours and not _path_exists(m.group(1), m.group(2)):
            bad.append(m.group(0))
    basenames = {}
    for module in MODULES:
        basenames.setdefault(module.split(".")[-1], []).append(module)
    for m in re.finditer(r"`([a-z_]\w*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`", line):
        module, name = m.groups()
        if module in SECTIONS or module in ("deepspec", "datasets") or module not in basenames or name in EXTENSIONS:
            continue  # a setting, the package, Hugging Face's datasets, a file name
        if not any(name in _defined(MODULES[x]) for x in basenames[module]):
            bad.append(m.group(0))
    return bad


def test_names_in_docstrings_and_docs_exist():
    bad = [f"{f.relative_to(REPO)}:{n}: {ref}" for f in PROSE
           for n, line in enumerate(f.read_text().splitlines(), 1) for ref in _stale_names(line)]
    assert not bad, bad


def test_the_name_check_catches_a_stale_name():
    assert _stale_names("see `deepspec/interop/export.py`, deepspec.data.regenerate and `export.expected_tensors`") == [
        "deepspec.data.regenerate", "deepspec/interop/export.py", "`export.expected_tensors`"]
    assert _stale_names("`deepspec/formats/export.py:export_drafter`, `files.file_lock`, `train.lr`") == []


def test_ruff_is_clean():
    """The linter and the import order of pyproject.toml's [tool.ruff] hold everywhere."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ruff", "check", "deepspec", "tests", "benchmarks"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]

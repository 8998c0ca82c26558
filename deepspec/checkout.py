"""The checkout the DAG runs: its own deepspec package, presets and schema.

DeepSpec runs from a checkout (`pip install -e .`): `config.REPO_ROOT`, the
presets and the schema hang off the imported package's location. Two checkouts
may share one environment (a git worktree, a second clone), and then whatever
`deepspec` is installed is the other checkout's. The Snakefile therefore puts
its own directory first on sys.path before it imports deepspec, then calls
`enter`, which makes sure that the Snakefile and every job read this checkout:

- the imported package must be the one beside the Snakefile (it is not when
  another deepspec was imported into the Snakemake process first);
- the jobs run `python -m deepspec` in Snakemake's working directory, whose
  deepspec/ comes first on their sys.path: a working directory holding another
  checkout's package is refused;
- every job's python gets the checkout first on PYTHONPATH (a working directory
  without a deepspec/ then still imports this checkout's, and so do the
  processes the launchers start).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping, Optional

from .errors import DeepSpecError

PACKAGE_DIR = Path(__file__).resolve().parent


def enter(checkout: Path, cwd: Optional[Path] = None, environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Check that this package is `checkout`'s and that the jobs, run in `cwd`
    (default: the current directory), import it too; put `checkout` first on
    PYTHONPATH in `environ` (default: os.environ, which Snakemake's jobs inherit)."""
    checkout = Path(checkout).resolve()
    own = (checkout / "deepspec").resolve()
    if PACKAGE_DIR != own:
        raise DeepSpecError(f"the DAG in {checkout} would run the deepspec package of {PACKAGE_DIR.parent} "
                            f"(imported before the Snakefile could import its own): run snakemake in a fresh "
                            f"process from {checkout}")
    cwd = Path.cwd() if cwd is None else Path(cwd)
    local = cwd / "deepspec"
    if (local / "__init__.py").is_file() and local.resolve() != own:
        raise DeepSpecError(f"the jobs would run the deepspec package of the working directory {cwd.resolve()}, "
                            f"not that of the DAG's checkout {checkout}: run snakemake from {checkout} "
                            f"(or with that checkout's Snakefile)")
    environ = os.environ if environ is None else environ
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != checkout]
    environ["PYTHONPATH"] = os.pathsep.join([str(checkout), *rest])

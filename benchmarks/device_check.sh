#!/usr/bin/env bash
# The prepared GPU check (benchmarks/device_check.py): run from the repository
# root on a machine with one CUDA GPU, or with --cpu --small anywhere (CI).
#   bash benchmarks/device_check.sh OUTDIR [--cpu --small] [--preset qwen3-4b]
#   bash benchmarks/device_check.sh --prepare [DIR]   # on a machine with a registry, before the GPU run
# The GPU image has torch, transformers, accelerate, pandas, scipy, pyyaml, attrs
# but not jsonschema and its needs. --prepare downloads their CPython 3.12
# manylinux wheels (the image's python3) into DIR (default .whl/, git-ignored:
# carry it); the check installs whatever .whl/ holds into a temporary path first,
# from there only (--no-index).
set -euo pipefail
cd "$(dirname "$0")/.."
# pinned: the versions the tests run with (one version of each, or the install stops)
WHEELS=(jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0)
if [ "${1:-}" = "--prepare" ]; then
  dest="${2:-.whl}"
  mkdir -p "$dest"
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
  # shellcheck disable=SC2086  # DEVICE_CHECK_PIP may be a command with arguments
  ${DEVICE_CHECK_PIP:-python3 -m pip} download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" "${WHEELS[@]}"
  echo "wheels for the GPU machine in $dest: carry it with the check"
  exit 0
fi
# (only where python3 is the 3.12 they were downloaded for: a .whl/ left in a checkout must not break the CPU check)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/deepspec-site .whl/*.whl
  export PYTHONPATH="/tmp/deepspec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# one inductor cache for both processes (the check, then pytest): the second reuses the first's kernels
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/deepspec-inductor}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rc=0
python3 benchmarks/device_check.py "$@" || rc=$?
case " $* " in
  *" --cpu "*) ;;
  *)  # the CUDA-only tests of compiled flex attention (forward and backward against SDPA)
      python3 -m pytest -q -p no:cacheprovider tests/test_efficient_training.py -k cuda 2>&1 | tee "$1/pytest_cuda.txt" \
        || rc=1 ;;
esac
exit $rc

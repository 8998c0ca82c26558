#!/usr/bin/env bash
# The prepared GPU check (benchmarks/device_check.py): run from the repository
# root on a machine with one CUDA GPU, or with --cpu --small anywhere (CI).
#   bash benchmarks/device_check.sh OUTDIR [--cpu --small] [--preset qwen3-4b]
# The GPU machine has torch, transformers and accelerate but may lack small
# packages (jsonschema and its needs): put their wheels in .whl/ (git-ignored)
# and they are installed to a temporary path first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/deepspec-site .whl/*.whl
  export PYTHONPATH="/tmp/deepspec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
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

#!/usr/bin/env bash
# The GPU checks on a CUDA machine, from the repository root: installs any wheels found in
# .whl/ (for a machine without network access to a package index), reports the device,
# then runs the GPU-marked tests (one line per test as it ends, and the slowest) and any
# benchmarks named as arguments.
#   bash scripts/gpu_check.sh                      # GPU tests only
#   bash scripts/gpu_check.sh bench/decode.py ...  # plus benchmarks (each run with python)
set -uo pipefail
source scripts/wheels_env.sh || exit 2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# the whole log also goes to $OUT (the device tool brings it back) or /tmp, kept if a time limit stops it
python3 -m pytest -v -m gpu tests -p no:cacheprovider --durations=15 -rfE 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log" | tail -90
status=${PIPESTATUS[0]}
for bench in "$@"; do
  echo "== $bench"
  python3 $bench
done
exit $status

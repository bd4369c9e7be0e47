#!/usr/bin/env bash
# The GPU checks in one go (issue 15), for a machine with a CUDA device and the
# system Python that holds torch (and CuPy): builds mrc from source in-tree with
# meson + ninja (no meson-python, no venv), runs the GPU tests, then the GPU
# benchmark. A few minutes. Results go to $OUT (the device tool's) or build/gpu/.
# Usage: tools/gpu_check.sh [--quick]   (make gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-build/gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu-check needs a CUDA device (torch sees none)"
print("torch", torch.__version__, torch.cuda.get_device_name(0))
PYEOF
# Build: the extension lands in build/gpu; mrc/ imports it from the tree.
if [ ! -f build/gpu/build.ninja ]; then
  meson setup build/gpu --buildtype=release -Dpython.install_env=auto >/dev/null
fi
ninja -C build/gpu >/dev/null
cp build/gpu/_datapath*.so mrc/
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import mrc, mrc.gpu; print('mrc', mrc.__version__, 'from', mrc.__file__)"
# Tests: every GPU test, plus the staging tests that run anywhere.
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_torch.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log"
# The benchmark: CUDA tensors vs host memory vs Gloo with CUDA tensors.
"$PY" benchmarks/gpu_allreduce.py ${1:-} --out "$OUT/gpu_allreduce.json" 2>&1 | tee "$OUT/gpu_bench.log"

#!/usr/bin/env bash
# The tensor-core route on the lent GPU, in one call (about 3-6 minutes): the CUDA tests of the route and
# of the FP32 tiles it sits beside, then the benchmark. From the project's root, on the device machine:
#
#     bash benchmarks/tc_device.sh          (run's carry: [".device"])
#
# Results: benchmarks/results/tensor-cores-<gpu>.json, copied to $OUT (so it comes back) with the log.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
export LUISAML_BACKEND=cuda
out=${OUT:-/tmp/tc-out}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import luisaml, luisaml.tensor_cores as t; print('luisaml from', luisaml.__file__)"
  # -P: the checkout must not shadow /tmp/lm
  timeout 150 python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_cores_cuda.py 2>&1 | tail -40
  timeout 240 python3 -P benchmarks/bench_tensor_cores.py --reps 30 2>&1 | grep -v "^\[.*\] \[console\]"
  cp benchmarks/results/tensor-cores-*.json "$out"/ 2>/dev/null
  # the FP32 tiles' own CUDA tests, their kernels now built through the front (passed through unchanged)
  timeout 150 python3 -P -m pytest -q -p no:cacheprovider tests/gpu/test_blocks_cuda.py 2>&1 | tail -20
} 2>&1 | tee "$out/tc_device.log"

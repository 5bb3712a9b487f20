#!/usr/bin/env bash
# One prepared run on a GPU machine (H200): build the CUDA backend, run the
# GPU tests, time the backend and the Monitor (targets: benchmarks/RESULTS.md), and
# print the tables last. At most 530 s (the three timeouts) after the machine has started.
#
#   run(command="bash benchmarks/device_check.sh", carry=["build/gpu_wheels"], timeout_s=540)
#
# build/gpu_wheels (ignored by git) holds wheels the device lacks, fetched here
# with: pip download --no-deps -d build/gpu_wheels scipy-openblas32 pytest \
#       pluggy iniconfig packaging pygments
# Results: $OUT/gpu_check.json, $OUT/bench_monitor_gpu.json, $OUT/bench_monitor_head.json, $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/richness-device}
mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# gpu_check.py installs build/gpu_wheels, builds if richness._cuda does not
# import, runs tests/test_cuda.py, then times (under 5 minutes).
timeout 320 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log" | tail -60
echo "gpu_check exit: ${PIPESTATUS[0]}"
# Monitor overhead: ResNet-18-like, batch 256, configurations alternating by block.
timeout 160 python3 benchmarks/bench_monitor_gpu.py --blocks 12 --block 20 2>&1 | tee "$OUT/bench_monitor_gpu.log" | tail -12
echo "bench_monitor_gpu exit: ${PIPESTATUS[0]}"
# Monitor every=1 at an ImageNet head (p=2048, C=1000, batch 256): per-step cost on the device.
timeout 50 python3 benchmarks/bench_monitor_head.py --device cuda --groups 4 --json "$OUT/bench_monitor_head.json" \
  2>&1 | tee "$OUT/bench_monitor_head.log" | tail -4
echo "bench_monitor_head exit: ${PIPESTATUS[0]}"

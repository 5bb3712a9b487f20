#!/usr/bin/env bash
# One prepared run on a GPU machine (H200): build the CUDA backend, run the
# GPU tests, time the backend, evaluate() and the Monitor (targets:
# benchmarks/RESULTS.md), and print the tables last. At most 535 s (the four
# timeouts) after the machine has started.
#
#   run(command="bash benchmarks/device_check.sh", carry=["build/gpu_wheels"], timeout_s=540)
#
# build/gpu_wheels (ignored by git) holds wheels the device lacks, fetched here
# with: pip download --no-deps -d build/gpu_wheels scipy-openblas32 pytest \
#       pluggy iniconfig packaging pygments
# Results: $OUT/gpu_check.json, $OUT/bench_evaluate_gpu.json, $OUT/bench_monitor_head.json, $OUT/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/richness-device}
mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# gpu_check.py installs build/gpu_wheels, builds if richness._cuda does not
# import, runs tests/engine/test_cuda.py, then times (under 5 minutes). Its table
# (streaming against torch, each mode as a fraction of the tensor-core
# ceiling) is printed again at the end.
timeout 300 python3 benchmarks/gpu_check.py > "$OUT/gpu_check.log" 2>&1
echo "gpu_check exit: $?"
grep -E "tests/engine/test_cuda.py|FAILED|passed|failed" "$OUT/gpu_check.log" | tail -8
# evaluate() on a ResNet-50 (bf16 autocast, channels_last, batch 256) against the plain loop, and the report alone.
timeout 120 python3 benchmarks/bench_evaluate_gpu.py --images 25000 --rounds 2 --json "$OUT/bench_evaluate_gpu.json" \
  > "$OUT/bench_evaluate_gpu.log" 2>&1
echo "bench_evaluate_gpu exit: $?"
# Monitor overhead: ResNet-18-like, batch 256, configurations alternating by block.
timeout 70 python3 benchmarks/bench_monitor_gpu.py --blocks 6 --block 20 > "$OUT/bench_monitor_gpu.log" 2>&1
echo "bench_monitor_gpu exit: $?"
# Monitor every=1 at an ImageNet head (p=2048, C=1000, batch 256): per-step cost on the device.
timeout 45 python3 benchmarks/bench_monitor_head.py --device cuda --groups 4 --json "$OUT/bench_monitor_head.json" \
  > "$OUT/bench_monitor_head.log" 2>&1
echo "bench_monitor_head exit: $?"
# Tables last.
echo "==== streaming (gpu_check) ===="; sed -n '/^streaming n=/,$p' "$OUT/gpu_check.log"
echo "==== evaluate ===="; tail -5 "$OUT/bench_evaluate_gpu.log"
echo "==== Monitor ===="; tail -12 "$OUT/bench_monitor_gpu.log"; tail -4 "$OUT/bench_monitor_head.log"

#!/usr/bin/env bash
# The CPU speed measurements of benchmarks/RESULTS.md ("CPU products at the
# BLAS limit"), in one go, on a quiet machine (about 10-12 minutes on 2 cores):
#   1. cpu_side_by_side.py three times at p = 1024 and three times at p = 2048
#      (torch's one GEMM, torch's three GEMMs, richness head mode and streamed
#      outputs, interleaved in each run);
#   2. bench_eval_large.py: richness eval of a 1.3M x 2048 float16 file with a
#      1000-class head, with its two limits measured in the same run (the
#      arithmetic at torch's measured GEMM rate; cat to /dev/null, cold and
#      warm); the 5.3 GB file is created under $RICHNESS_BENCH_DIR and deleted;
#   3. bench_monitor.py over the every / window settings (--all), twice.
# Raw output goes to benchmarks/results/cpu_speed_<UTC time>/ (one .txt and
# one .json per run, plus machine.txt).
#
# OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are unset for these commands alone,
# so that OpenBLAS picks its own kernel for this processor; machine.txt
# records the kernel that ran.
#
#   bash benchmarks/run_cpu_speed.sh          # the measurements
#   QUICK=1 bash benchmarks/run_cpu_speed.sh  # small sizes, a minute: checks the script end to end
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."
quick="${QUICK:-0}"
stamp="$(date -u +%Y%m%d-%H%M)"
out="${RICHNESS_RESULTS_DIR:-benchmarks/results/cpu_speed_${stamp}$([ "$quick" = 1 ] && echo _quick || true)}"
data="${RICHNESS_BENCH_DIR:-$(mktemp -d -t richness-cpu-speed.XXXXXX)}"
mkdir -p "$out" "$data"
py="${PYTHON:-python}"
bench() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$@"; }
cleanup() { rm -rf "$data"; }
trap cleanup EXIT

if [ "$quick" = 1 ]; then
  widths=(256 512)
  sbs_args=(--n 8192 --batch 2048 --repeats 2)
  eval_args=(--rows 40000 --features 256 --classes 100)
  mon_args=(--steps 200 --warmup 5)
else
  widths=(1024 2048)
  sbs_args=(--batch 4096 --repeats 5)
  eval_args=(--rows 1300000 --features 2048 --classes 1000)
  mon_args=(--steps 600)
fi

log() { echo "== $(date -u '+%H:%M:%S') $* | $(uptime | sed 's/.*load/load/')" | tee -a "$out/progress.txt"; }

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "uptime: $(uptime)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "environment OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-<unset>} OPENBLAS_L2_SIZE=${OPENBLAS_L2_SIZE-<unset>} (unset for the runs below)"
  echo "kernel (as the runs see it):"
  bench "$py" -c "import richness, threadpoolctl, torch; print(' richness:', richness.blas_info()); import re; print(' torch:', torch.__version__, re.findall(r'BLAS_INFO=\\w+', torch.__config__.show()), torch.get_num_threads(), 'threads'); print(' threadpoolctl:', [(d['internal_api'], d.get('architecture'), d['num_threads']) for d in threadpoolctl.threadpool_info()])" 2>&1 || bench "$py" -c "import richness; print(' richness:', richness.blas_info())"
  df -h "$data" | tail -1 | awk '{print "disk free at " $6 ": " $4}'
  free -g | awk 'NR==2 {print "memory free: " $7 " GB"}'
} | tee "$out/machine.txt"

for run in 1 2 3; do
  for p in "${widths[@]}"; do
    args=("${sbs_args[@]}" --p "$p")
    # n = 65,536 at p = 1024, 32,768 at p = 2048 (each run about half a minute)
    [ "$quick" = 1 ] || args+=(--n "$((65536 * 1024 / p))")
    rss=()
    [ "$run" = 1 ] || rss=(--no-rss)  # peak memory once per width
    log "cpu_side_by_side p=$p run $run"
    bench "$py" benchmarks/cpu_side_by_side.py "${args[@]}" "${rss[@]}" --json "$out/sbs_p${p}_run${run}.json" \
      2>&1 | tee "$out/sbs_p${p}_run${run}.txt"
  done
done

log "bench_eval_large"
bench "$py" benchmarks/bench_eval_large.py --dir "$data" "${eval_args[@]}" --json "$out/eval_large.json" \
  2>&1 | tee "$out/eval_large.txt"

for run in 1 2; do
  log "bench_monitor run $run"
  bench "$py" benchmarks/bench_monitor.py --all "${mon_args[@]}" --json "$out/monitor_run${run}.json" \
    2>&1 | tee "$out/monitor_run${run}.txt"
done

log "done"
echo "uptime at the end: $(uptime)" | tee -a "$out/machine.txt"
echo "results in $out"

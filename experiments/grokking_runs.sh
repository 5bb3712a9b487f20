#!/bin/bash
# The CPU runs behind docs/REPRODUCTION.md, grokking: one torch thread each, at
# most two at a time. Rerunning a group continues each run from its checkpoint
# (experiments/results/checkpoints/); a finished run only rewrites its files.
#   experiments/grokking_runs.sh seeds | clipped | sweep | width
#   experiments/grokking_runs.sh after PID GROUP...   # the groups once process PID has ended
#   experiments/grokking_runs.sh TAG OPTS             # one run
cd "$(dirname "$0")/.."
mkdir -p experiments/results/checkpoints
run() {  # tag, then options
    local tag=$1; shift
    local resume=""
    [ -f "experiments/results/checkpoints/grokking_$tag.pt" ] && resume=--resume
    python experiments/grokking.py --tag "$tag" $resume "$@" >> "experiments/results/checkpoints/grokking_$tag.log" 2>&1
}
# mod 59, 50% of the pairs, d 128, weight decay 3, lr 1e-3, no clipping (the script's default full
# setting): each seed ends at the first checkpoint past 3x its test-jump step.
seed() { run p59_noclip_s$1 --seed $1 --clip 0 --warmup 0 --steps 6000 --stop-after-jump 3; }
seeds() {
    seed 0; seed 1; seed 2
    python experiments/grokking.py --overlay experiments/results/grokking_p59_noclip_s{0,1,2}.json
}
# The same with gradient-norm clipping at 1 and 10 warmup steps: grokking comes later and smoothly.
# Seed 1 runs to 3x its jump; seed 0 was stopped at step 4,750 (1.7x its jump) for CPU time.
clipped() {
    run p59_s0 --seed 0 --clip 1 --warmup 10 --steps 4750 --stop-after-jump 3
    run p59_s1 --seed 1 --clip 1 --warmup 10 --steps 6300 --stop-after-jump 3
}
sweep() {  # the early phase against the output scale: alpha at a fixed lr, and alpha with lr / alpha
    for a in 1 4; do
        [ -f "experiments/results/grokking_sweep_a$a.json" ] ||
            run sweep_a$a --alpha $a --clip 1 --warmup 10 --steps 200 --rank-every 100 --checkpoint-every 100
    done
    for a in 8 32; do run sweep_a${a}_scaled --alpha $a --scale-lr --clip 0 --warmup 0 --steps 100 --rank-every 50 --checkpoint-every 50; done
    run sweep_a8_scaled --alpha 8 --scale-lr --clip 0 --warmup 0 --steps 1000 --rank-every 50 --checkpoint-every 50
}
width() {  # p against C at a small modulus: mod 23 (C = 23) with d = 32 and d = 128
    run p23_d32 --P 23 --d 32 --ff 128 --clip 0 --warmup 0 --steps 2500 --stop-after-jump 3
    run p23_d128 --P 23 --d 128 --clip 0 --warmup 0 --steps 7500 --stop-after-jump 3
}
case "${1:-seeds}" in
    seeds|clipped|sweep|width) "$1" ;;
    after)
        while kill -0 "$2" 2>/dev/null; do sleep 15; done
        shift 2
        for g in "$@"; do case "$g" in seed[0-9]) seed "${g#seed}" ;; *) "$g" ;; esac; done ;;
    *) run "$@" ;;
esac

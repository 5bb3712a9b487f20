#!/bin/bash
# The CPU runs behind docs/REPRODUCTION.md, grokking, one torch thread each, at
# most two at a time. The seeds end at the first checkpoint past 3x their
# test-jump step (or at --steps). Rerunning a group continues each run from its
# checkpoint (experiments/results/checkpoints/).
#   experiments/grokking_runs.sh seeds | noclip | sweep | width
#   experiments/grokking_runs.sh after PID GROUP   # GROUP once process PID has ended
#   experiments/grokking_runs.sh TAG OPTS          # one run
cd "$(dirname "$0")/.."
mkdir -p experiments/results/checkpoints
run() {  # tag, then options
    local tag=$1; shift
    local resume=""
    [ -f "experiments/results/checkpoints/grokking_$tag.pt" ] && resume=--resume
    python experiments/grokking.py --tag "$tag" $resume "$@" >> "experiments/results/checkpoints/grokking_$tag.log" 2>&1
}
seeds() {  # mod 59, 50% of the pairs, d 128, weight decay 3 (the script's default full setting)
    run p59_s0 --seed 0 --steps 6000 --stop-after-jump 3 &
    run p59_s1 --seed 1 --steps 6000 --stop-after-jump 3 &
    wait
    run p59_s2 --seed 2 --steps 6000 --stop-after-jump 3
}
noclip() {  # seed 0 without gradient clipping or warmup
    run p59_noclip_s0 --seed 0 --clip 0 --warmup 0 --steps 6000 --stop-after-jump 3
}
sweep() {  # the early phase against the output scale: alpha at a fixed lr, and alpha with lr / alpha, wd * alpha
    for a in 1 4; do
        [ -f "experiments/results/grokking_sweep_a$a.json" ] || run sweep_a$a --alpha $a --steps 200 --rank-every 100 --checkpoint-every 100
    done
    for a in 8 32; do run sweep_a${a}_scaled --alpha $a --scale-lr --steps 200 --rank-every 100 --checkpoint-every 100; done
}
width() {  # p against C at a small modulus: mod 23 (C = 23) with d = 32 and d = 128
    run p23_d32 --P 23 --d 32 --ff 128 --steps 4000 --stop-after-jump 3
    run p23_d128 --P 23 --d 128 --steps 4000 --stop-after-jump 3
}
case "${1:-seeds}" in
    seeds|noclip|sweep|width) "$1" ;;
    after)
        while kill -0 "$2" 2>/dev/null; do sleep 15; done
        shift 2
        case "$1" in seeds|noclip|sweep|width) for g in "$@"; do "$g"; done ;; *) run "$@" ;; esac ;;
    *) run "$@" ;;
esac

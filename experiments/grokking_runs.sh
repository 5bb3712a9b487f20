#!/bin/bash
# The CPU runs behind docs/REPRODUCTION.md, grokking, two at a time, one torch
# thread each. Each run ends at the first checkpoint past 3x its test-jump step
# (or at --steps). Rerunning continues each run from its checkpoint.
#   experiments/grokking_runs.sh            # the three seeds and the side runs
#   experiments/grokking_runs.sh TAG OPTS   # one run
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
case "${1:-seeds}" in
    seeds) seeds ;;
    *) run "$@" ;;
esac

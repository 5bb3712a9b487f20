#!/bin/bash
# The CPU runs behind docs/REPRODUCTION.md, grokking: three seeds of the default
# setting (mod 59, 50% of the pairs, d 128, weight decay 3), two at a time, one
# torch thread each. Rerunning continues each run from its checkpoint.
cd "$(dirname "$0")/.."
mkdir -p experiments/results/checkpoints
run() {  # tag, then options
    local tag=$1; shift
    local resume=""
    [ -f "experiments/results/checkpoints/grokking_$tag.pt" ] && resume=--resume
    python experiments/grokking.py --tag "$tag" $resume "$@" >> "experiments/results/checkpoints/grokking_$tag.log" 2>&1
}
case "${1:-seeds}" in
    seeds)
        run p59_s0 --seed 0 &
        run p59_s1 --seed 1 &
        wait
        run p59_s2 --seed 2 ;;
    *) run "$@" ;;
esac

#!/usr/bin/env bash
# Tokens per second of `qkv train` on this machine: 1 process × 1 thread, 1 process × 2 threads and 2 processes ×
# 1 thread, side by side in one run (medians over repeats), and the communication share of a step at GPT-2 124M's
# shape on 2 local processes. Usage: tools/bench_mpi.sh [BUILD_DIR] [REPEATS]
set -euo pipefail
build=${1:-build}
repeats=${2:-3}
qkv=$(realpath "$build/qkv")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bible -l80 gen1:1-rev22:21 > "$work/kjv.txt"
mpi=(mpirun --oversubscribe)
[[ $(id -u) -eq 0 ]] && mpi+=(--allow-run-as-root)
# The default configuration (21M parameters, GPT-2 vocabulary, context 128), 30 steps of 8 windows.
default=(--text "$work/kjv.txt" --steps 30 --eval-every 0 --checkpoint-every 0 --sample-tokens 1)
rate() {  # median tokens/s of steps 6… in losses.csv
  tail -n +8 "$1/losses.csv" | cut -d, -f5 | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'
}
comm_share() {  # median of communication seconds / step seconds (tokens/s → seconds)
  tail -n +5 "$1/losses.csv" | awk -F, -v tokens="$2" '{ print $8 / (tokens / $5) }' | sort -n |
    awk '{ a[NR] = $1 } END { printf "%.1f%%", 100 * a[int((NR + 1) / 2)] }'
}
declare -a one two ranks
for r in $(seq "$repeats"); do
  OMP_NUM_THREADS=1 "$qkv" train "${default[@]}" --batch-size 8 --out "$work/a$r" >/dev/null 2>&1
  one+=("$(rate "$work/a$r")")
  OMP_NUM_THREADS=2 "$qkv" train "${default[@]}" --batch-size 8 --out "$work/b$r" >/dev/null 2>&1
  two+=("$(rate "$work/b$r")")
  "${mpi[@]}" -np 2 -x OMP_NUM_THREADS=1 "$qkv" train "${default[@]}" --batch-size 4 --out "$work/c$r" >/dev/null 2>&1
  ranks+=("$(rate "$work/c$r")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
m1=$(median "${one[@]}") m2=$(median "${two[@]}") m3=$(median "${ranks[@]}")
echo "default qkv train (global batch 8 × 128 tokens), tokens/s, medians of $repeats runs:"
echo "  1 process  × 1 thread : $m1   (runs: ${one[*]})"
echo "  1 process  × 2 threads: $m2   (runs: ${two[*]})"
echo "  2 processes × 1 thread: $m3   (runs: ${ranks[*]})"
awk -v a="$m1" -v b="$m2" -v c="$m3" 'BEGIN { printf "  2 processes / 1 process × 1 thread: %.2fx; / 1 process × 2 threads: %.2fx\n", c / a, c / b }'
# GPT-2 124M's shape (GPT-2 vocabulary, emb 768, 12 layers, 12 heads), 2 processes × 1 thread each. B 4 × T 64 is the
# smallest step (most communication per token); B 8 × T 256 is the step the bf16 and PyTorch comparisons use.
gpt2=(--text "$work/kjv.txt" --emb-dim 768 --n-layers 12 --n-heads 12 --steps 8 --eval-every 0
      --checkpoint-every 0 --sample-tokens 1 --drop-rate 0)
# The gradients' sum after the backward (bucket 0: dense, every row of the embeddings), in 25 MiB buckets during it
# (the default: the embeddings' reached rows only), and exchanged as bf16. "Communication" is every second rank 0
# spends inside the sums — the copies and adds during the backward and the wait after it — medians over steps 4…8.
echo "GPT-2 124M shape, 2 processes × 1 thread:"
for variant in "B 4 × T 64, after:2 64 --allreduce-bucket-mib 0" "B 4 × T 64, overlapped:2 64 --allreduce-bucket-mib 25" \
               "B 4 × T 64, overlapped, bf16:2 64 --allreduce-precision bf16" "B 8 × T 256, overlapped:4 256"; do
  name=${variant%%:*}
  read -r -a flags <<< "${variant#*:}"
  "${mpi[@]}" -np 2 -x OMP_NUM_THREADS=1 "$qkv" train "${gpt2[@]}" --batch-size "${flags[0]}" --context-length "${flags[1]}" \
    "${flags[@]:2}" --out "$work/g" --overwrite >/dev/null 2>&1
  echo "  $name: $(rate "$work/g") tokens/s; communication $(comm_share "$work/g" $((2 * flags[0] * flags[1]))) of a step"
done

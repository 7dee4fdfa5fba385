#!/usr/bin/env bash
# Data-parallel qkv train under mpirun (ctest, when qkv is built with MPI):
#  1. the same global batch trains the same way: 1 process × grad-accum 4, 2 × 2 and 4 × 1 (losses to 1e-5);
#  2. a run resumes with another number of processes when the global batch is the same, and says why not when not;
#  3. a process that cannot read its text stops every process with a message naming it;
#  4. continued pretraining of a Hugging Face folder (qkv train --resume DIR) on 2 processes equals 1 process;
#  5. a mixture of experts sums only the experts some process's tokens chose, with the dense sum's bits.
# Usage: mpi_train.sh QKV_BINARY SCRATCH_DIR [HF_LLAMA_FOLDER]
set -euo pipefail
qkv=$1
dir=$2
folder=${3:-}
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir"
for i in $(seq 60); do echo "In the beginning was the word; the fat cat sat on the mat $i. Then the dog ran after the cat."; done > text.txt
mpi=(mpirun --oversubscribe -x OMP_NUM_THREADS=1)
[[ $(id -u) -eq 0 ]] && mpi+=(--allow-run-as-root)
common=(--text text.txt --tokenizer bytes --context-length 32 --emb-dim 32 --n-heads 2 --n-layers 1 --drop-rate 0.1
        --batch-size 2 --steps 20 --eval-every 0 --sample-tokens 4 --lr 3e-3 --warmup 2)
losses() { cut -d, -f2 "$1/losses.csv" | tail -n +3; }
same() {  # two loss columns equal to 1e-5 relative
  paste -d' ' <(losses "$1") <(losses "$2") | awk -v a="$1" -v b="$2" '
    { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * ($1 < 0 ? -$1 : $1)) { print a " and " b " differ at row " NR ": " $1 " vs " $2; bad = 1 } }
    END { if (NR != 20) { print a ": " NR " rows, expected 20"; bad = 1 } exit bad }'
}
OMP_NUM_THREADS=1 "$qkv" train "${common[@]}" --grad-accum 4 --out one >/dev/null 2>&1
"${mpi[@]}" -np 2 "$qkv" train "${common[@]}" --grad-accum 2 --out two >/dev/null 2>&1
"${mpi[@]}" -np 4 "$qkv" train "${common[@]}" --grad-accum 1 --out four >/dev/null 2>&1
same one two
same one four
echo "equivalence: 1 x 4, 2 x 2 and 4 x 1 give the same 20 losses (dropout 0.1 included)"

# Gradients summed in buckets while the backward goes on (1 MiB buckets: several; of the 20,000-token table only the
# rows the batch reached) give the bits of one dense sum after the backward; exchanged as bf16 they track it.
wide=(--text text.txt --tokenizer bytes --vocab-size 20000 --context-length 32 --emb-dim 64 --n-heads 2 --n-layers 2
      --drop-rate 0.1 --batch-size 2 --eval-every 0 --sample-tokens 4 --lr 3e-3 --warmup 2 --steps)
"${mpi[@]}" -np 2 "$qkv" train "${wide[@]}" 20 --allreduce-bucket-mib 0 --out after >/dev/null 2>&1
"${mpi[@]}" -np 2 "$qkv" train "${wide[@]}" 20 --allreduce-bucket-mib 1 --out overlapped >/dev/null 2>&1
"${mpi[@]}" -np 2 "$qkv" train "${wide[@]}" 20 --allreduce-precision bf16 --out bf16 >/dev/null 2>&1
weights() {  # a checkpoint's tensors: the bytes after the header (whose settings differ)
  /usr/bin/python3 -c 'import struct, sys; b = open(sys.argv[1], "rb").read(); sys.stdout.buffer.write(b[8 + struct.unpack("<Q", b[:8])[0]:])' "$1"
}
cmp <(cut -d, -f2 after/losses.csv) <(cut -d, -f2 overlapped/losses.csv) ||
  { echo "summing in buckets during the backward changed the losses"; exit 1; }
cmp <(weights after/checkpoint.safetensors) <(weights overlapped/checkpoint.safetensors) ||
  { echo "summing in buckets during the backward changed the weights"; exit 1; }
# Three processes: a rank between the first and the last adds its copy in the middle of the rank order.
"${mpi[@]}" -np 3 "$qkv" train "${wide[@]}" 6 --allreduce-bucket-mib 0 --out after3 >/dev/null 2>&1
"${mpi[@]}" -np 3 "$qkv" train "${wide[@]}" 6 --allreduce-bucket-mib 1 --out overlapped3 >/dev/null 2>&1
cmp <(weights after3/checkpoint.safetensors) <(weights overlapped3/checkpoint.safetensors) ||
  { echo "3 processes: summing in buckets during the backward changed the weights"; exit 1; }
paste -d' ' <(losses after) <(losses bf16) | awk '
  { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-2 * $1) { print "bf16 exchange: row " NR ": " $1 " vs " $2; bad = 1 } }
  END { if (NR != 20) { print "bf16 exchange: " NR " rows"; bad = 1 } exit bad }'
echo "overlap: 1 MiB buckets during the backward (the embeddings' reached rows only) give the same bits as one"
echo "  dense sum after it, on 2 and 3 processes; bf16 exchange within 1%"

# A mixture of experts (32 experts, 2 a token, 32 tokens a step on each process): the experts no process's tokens
# chose are not summed (their gradients are zero everywhere), and the weights are the bits of the dense sum.
moe=(--text text.txt --tokenizer bytes --context-length 16 --emb-dim 32 --n-heads 2 --n-layers 2 --attention gqa
     --experts 32 --experts-per-token 2 --drop-rate 0.1 --batch-size 2 --eval-every 0 --sample-tokens 4 --lr 3e-3
     --warmup 2 --steps 6)
"${mpi[@]}" -np 2 "$qkv" train "${moe[@]}" --allreduce-bucket-mib 0 --out moe_after >/dev/null 2>&1
"${mpi[@]}" -np 2 "$qkv" train "${moe[@]}" --allreduce-bucket-mib 1 --out moe_skipped > moe.txt 2>&1
cmp <(weights moe_after/checkpoint.safetensors) <(weights moe_skipped/checkpoint.safetensors) ||
  { echo "summing only the chosen experts changed the weights"; exit 1; }
skipped=$(sed -n "s/.*summed across processes, \([0-9]*\) not.*/\1/p" moe.txt | head -1)
[[ -n "$skipped" && "$skipped" -gt 0 ]] || { echo "no expert's sum was skipped:"; cat moe.txt; exit 1; }
echo "$(grep -m1 "experts' gradients" moe.txt | sed 's/.*experts/experts/'); the dense sum's bits"

# Stop at step 8 on 2 processes, continue on 1 process with grad-accum 4: the same as the straight run.
"${mpi[@]}" -np 2 "$qkv" train "${common[@]}" --grad-accum 2 --stop-at 8 --out split >/dev/null 2>&1
OMP_NUM_THREADS=1 "$qkv" train --resume split/checkpoint.safetensors --text text.txt --grad-accum 4 --out split \
  --sample-tokens 4 >/dev/null 2>&1
same one split
echo "resume: 2 processes to step 8, then 1 process to step 20, equals the straight run"
if OMP_NUM_THREADS=1 "$qkv" train --resume split/checkpoint.safetensors --text text.txt --grad-accum 2 --steps 30 \
     --out split > refused.txt 2>&1; then
  echo "a resume with another global batch was accepted"; exit 1
fi
grep -q "global batch: checkpoint 1 process(es) × batch 2 × grad-accum 4 = 8 windows" refused.txt || { cat refused.txt; exit 1; }
echo "resume with another global batch: refused with the reason"

# Process 1 cannot read its text: every process stops, the message names it, no checkpoint appears.
set +e
"${mpi[@]}" -np 2 bash -c 'T=text.txt; [ "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}" = 1 ] && T=/nonexistent/text.txt;
  exec "$0" train --text "$T" --tokenizer bytes --context-length 32 --emb-dim 32 --n-heads 2 --n-layers 1 --steps 3 --out failed' \
  "$qkv" > failed.txt 2>&1
code=$?
set -e
[[ $code -ne 0 ]] || { echo "a failing process did not fail the run"; exit 1; }
grep -q "rank 1: /nonexistent/text.txt: cannot open" failed.txt || { cat failed.txt; exit 1; }
[[ ! -e failed/checkpoint.safetensors ]] || { echo "a checkpoint was written"; exit 1; }
echo "a failing process: every process stopped, naming rank 1"
if [[ -n "$folder" ]]; then
  # The tiny Llama folder with a character-level tokenizer.json: global batch 4 as 1 × 4 and 2 × 2.
  cp -r "$folder" llama
  /usr/bin/python3 - <<'PY'
import json
chars = " abcdefghijklmnopqrstuvwxyz"
json.dump({"model": {"type": "BPE", "vocab": {c: i + 4 for i, c in enumerate(chars)}, "merges": []}}, open("llama/tokenizer.json", "w"))
open("cats.txt", "w").write("the cat sat on the mat " * 60)
PY
  folder_args=(--text cats.txt --steps 20 --context-length 32 --lr 3e-3 --warmup 2 --eval-every 10 --eval-batches 1)
  OMP_NUM_THREADS=1 "$qkv" train --resume llama "${folder_args[@]}" --batch-size 4 --out folder_one >/dev/null 2>&1
  "${mpi[@]}" -np 2 "$qkv" train --resume llama "${folder_args[@]}" --batch-size 2 --out folder_two >/dev/null 2>&1
  losses() { cut -d, -f2 "$1/losses.csv" | tail -n +2; }
  same folder_one folder_two
  [[ -f folder_two/model/config.json ]] || { echo "folder_two/model was not written"; exit 1; }
  echo "a Hugging Face folder: 2 processes x batch 2 continue it as 1 process x batch 4 does"
fi
echo "mpi: all passed"

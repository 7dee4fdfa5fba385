#!/usr/bin/env bash
# qkv's GPT-2 tokenizer against tiktoken (npm, run with node) on more than 1 MB of varied text: the King
# James Bible, a Unicode stress text, and qkv's own source code. Each corpus must give identical ids.
# The corpora go through each side as one text (one process each; starting them costs more than the text), and a
# difference is then located corpus by corpus.
#   tokenizer_vs_tiktoken.sh QKV_BINARY TIKTOKEN_DIR SOURCE_DIR
set -euo pipefail
qkv=$(realpath "$1") tiktoken=$(realpath "$2") src=$(realpath "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bible -l80 gen1:1-rev22:21 > "$work/kjv_full.txt"
head -c 1200000 "$work/kjv_full.txt" > "$work/kjv.txt"
for i in $(seq 20); do cat "$src/tests/fixtures/unicode_stress.txt"; done > "$work/unicode.txt"
find "$src/src" "$src/include" "$src/apps" "$src/tests" "$src/tools" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.py' \) \
  | sort | xargs cat > "$work/code.txt"
corpora=(kjv unicode code)
for corpus in "${corpora[@]}"; do cat "$work/$corpus.txt"; done > "$work/all.txt"
ids() {  # file: qkv's ids in FILE.qkv.json, tiktoken's in FILE.tiktoken.json; fails when they differ
  "$qkv" tokenize --vocab "$src/data/gpt2" < "$1" > "$1.qkv.json"
  node "$src/tests/tiktoken_ids.js" "$tiktoken" < "$1" > "$1.tiktoken.json"
  cmp -s "$1.qkv.json" "$1.tiktoken.json"
}
total=$(wc -c < "$work/all.txt")
if ! ids "$work/all.txt"; then
  for corpus in "${corpora[@]}"; do
    ids "$work/$corpus.txt" || echo "FAIL: $corpus ($(wc -c < "$work/$corpus.txt") bytes): qkv and tiktoken ids differ"
  done
  echo "FAIL: qkv and tiktoken ids differ"
  exit 1
fi
echo "${corpora[*]}: $total bytes, $(tr ',' '\n' < "$work/all.txt.qkv.json" | wc -l) ids, identical"
echo "all identical over $total bytes"
[[ $total -ge 1000000 ]]

#!/usr/bin/env bash
# qkv's GPT-2 tokenizer against tiktoken (npm, run with node) on more than 1 MB of varied text: the King
# James Bible, a Unicode stress text, and qkv's own source code. Each corpus must give identical ids.
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
total=0
for corpus in kjv unicode code; do
  "$qkv" tokenize --vocab "$src/data/gpt2" < "$work/$corpus.txt" > "$work/$corpus.qkv.json"
  node "$src/tests/tiktoken_ids.js" "$tiktoken" < "$work/$corpus.txt" > "$work/$corpus.tiktoken.json"
  bytes=$(wc -c < "$work/$corpus.txt")
  total=$((total + bytes))
  if ! cmp -s "$work/$corpus.qkv.json" "$work/$corpus.tiktoken.json"; then
    echo "FAIL: $corpus ($bytes bytes): qkv and tiktoken ids differ"
    exit 1
  fi
  echo "$corpus: $bytes bytes, $(tr ',' '\n' < "$work/$corpus.qkv.json" | wc -l) ids, identical"
done
echo "all identical over $total bytes"
[[ $total -ge 1000000 ]]

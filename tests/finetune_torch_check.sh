#!/bin/sh
# What qkv finetune classify writes, read by PyTorch 1.13 on data nobody here tuned to (King James verses labelled by
# testament, from Debian's bible-kjv): the fine-tuned model.pth in the book's GPTModel with a new out_head classifies
# the test verses as qkv reported, and the PEFT adapter on the base model gives the merged model's logits.
#   tests/finetune_torch_check.sh QKV SOURCE_DIR WORK_DIR
set -eu
qkv=$1 src=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
bible -l 0 "gen1:1-gen11:32" > "$work/text.txt"
"$qkv" train --text "$work/text.txt" --tokenizer bytes --vocab-size 256 --context-length 128 --emb-dim 48 --n-heads 2 \
  --n-layers 2 --batch-size 8 --eval-every 0 --sample-tokens 0 --lr 3e-3 --warmup 10 --steps 60 --out "$work/base" >/dev/null
"$qkv" convert "$work/base/checkpoint.safetensors" "$work/base.pth" --weights-only >/dev/null
/usr/bin/python3 "$src/tools/kjv_testament.py" --out "$work/kjv" --train 64 --val 16 --test 40 --seed 5
common="--train $work/kjv/train.csv --val $work/kjv/val.csv --test $work/kjv/test.csv --epochs 2 --batch-size 8 --lr 2e-3"
"$qkv" finetune classify --checkpoint "$work/base.pth" --n-heads 2 --tokenizer bytes $common --trainable all --out "$work/full" >/dev/null
"$qkv" finetune classify --checkpoint "$work/base.pth" --n-heads 2 --tokenizer bytes $common --lora-rank 4 --lora-alpha 8 \
  --pooling last-real --out "$work/lora" >/dev/null
# Both folders in one Python process: importing torch costs more than checking them.
/usr/bin/python3 "$src/tools/finetune_reference.py" --check-written "$work/full" --check-written "$work/lora" \
  --test "$work/kjv/test.csv" --base "$work/base.pth" --adapter "$work/lora"

#!/bin/sh
# What qkv writes, read by PyTorch 1.13 (Debian's python3-torch; scripts/run test installs it): qkv converts the
# book's fixture files, then tools/pth_reference.py --check-written loads model.pth with weights_only=True into the
# book's GPTModel (strict) and compares every tensor, and loads model_and_optimizer.pth into torch.optim.AdamW.
#   tests/pth_torch_check.sh QKV SOURCE_DIR WORK_DIR
set -eu
qkv=$1 src=$2 work=$3
fixtures=$src/tests/fixtures/pth
rm -rf "$work" && mkdir -p "$work"
"$qkv" convert "$fixtures/model.pth" "$work/model.pth" --config "$fixtures/config.json"
# Through a qkv checkpoint and back: the optimizer state survives both conversions.
"$qkv" convert "$fixtures/model_and_optimizer.pth" "$work/checkpoint.safetensors" --to checkpoint --config "$fixtures/config.json"
"$qkv" convert "$work/checkpoint.safetensors" "$work/model_and_optimizer.pth"
cp "$fixtures/config.json" "$work/"
/usr/bin/python3 "$src/tools/pth_reference.py" --check-written "$work" --out "$fixtures"

#!/usr/bin/env bash
# Runs tools/llamacpp.c (llama.cpp's quantizer and greedy generation through node-llama-cpp's prebuilt libllama),
# building it first: llama.cpp's headers come from the source bundle inside the npm package, at the commit its
# binaries were built from. Usage: tools/llamacpp.sh [--cpu VARIANT] quantize|generate|tokenize|bench|kl ARGS…
# NODE_MODULES (default .cache/node/node_modules) must hold node-llama-cpp 3.22.1 (npm install node-llama-cpp@3.22.1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
modules=${NODE_MODULES:-$root/.cache/node/node_modules}
bins=$modules/@node-llama-cpp/linux-x64/bins/linux-x64
bundle=$modules/node-llama-cpp/llama/gitRelease.bundle
[[ -f $bins/libllama.v0.5.0.so && -f $bundle ]] || { echo "node-llama-cpp 3.22.1 is not in $modules" >&2; exit 1; }
work=${LLAMACPP_WORK:-$root/build/llamacpp}
mkdir -p "$work"
if [[ ! -d $work/src ]]; then
  git clone --quiet "$bundle" "$work/src.tmp" && mv "$work/src.tmp" "$work/src"
fi
if [[ ! -x $work/llamacpp || $root/tools/llamacpp.c -nt $work/llamacpp ]]; then
  cc -O2 -Wall -I "$work/src/include" -I "$work/src/ggml/include" "$root/tools/llamacpp.c" -L "$bins" \
    -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so -l:libggml-base.so -lm -Wl,-rpath,"$bins" -o "$work/llamacpp"
fi
LLAMACPP_BINS=$bins exec "$work/llamacpp" "$@"

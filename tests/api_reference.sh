#!/usr/bin/env bash
# The API reference builds from the public headers with no Doxygen warning: every public name documented (the
# headers' // comments, through docs/doxygen/comments_as_docs.py), no broken markup. Usage: api_reference.sh SOURCE OUT
set -euo pipefail
source_dir=$1 out=$2
command -v doxygen >/dev/null || { echo "doxygen is missing (apt-get install doxygen; scripts/run test installs it)"; exit 1; }
rm -rf "$out" && mkdir -p "$out"
cd "$source_dir"
{ cat docs/doxygen/Doxyfile; echo "OUTPUT_DIRECTORY = $out"; echo "WARN_LOGFILE = $out/warnings.txt"; } | doxygen - >/dev/null
[[ -f "$out/html/index.html" ]] || { echo "no $out/html/index.html"; exit 1; }
if [[ -s "$out/warnings.txt" ]]; then
  cat "$out/warnings.txt"
  echo "$(wc -l < "$out/warnings.txt") Doxygen warning(s): document the names above in their headers"
  exit 1
fi
echo "API reference: $(ls "$out/html" | wc -l) pages, no warnings"

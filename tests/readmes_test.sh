#!/usr/bin/env bash
# The README check on the repository, and on a small tree it must reject: a file its folder's README
# leaves out, a README that names a file only in prose, and a folder without a README.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/readmes_check.sh" "$here/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/t/model" "$tmp/t/loss" "$tmp/t/data"
touch "$tmp/t/model/kv_cache.h" "$tmp/t/model/kv_cache.cpp" "$tmp/t/model/lora.cpp" "$tmp/t/loss/cce.cpp" "$tmp/t/data/x.h"
printf -- '- `kv_cache.*`: the cache\n' > "$tmp/t/model/README.md"
printf -- '- cce.cpp, in prose only\n' > "$tmp/t/loss/README.md"
out=$(bash "$here/readmes_check.sh" "$tmp/t" || true)
for want in "model/README.md does not list lora.cpp" "loss/README.md does not list cce.cpp" "data/: no README.md"; do
  grep -qF "$want" <<< "$out" || { echo "the README check did not say: $want"; echo "$out"; exit 1; }
done
grep -q "kv_cache" <<< "$out" && { echo "the README check refused kv_cache, which model/README.md lists as kv_cache.*"; exit 1; }
echo "rejected: $(wc -l <<< "$out") omissions in the broken tree"

#!/usr/bin/env bash
# Fails when any C++/CUDA source differs from clang-format's output (style: .clang-format at the root).
# Fix with: clang-format -i $(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' 2>/dev/null || true)
[ -n "$files" ] || files=$(find loss trainer apps tests \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \))
clang-format --dry-run --Werror $files
echo "clang-format: $(echo "$files" | wc -w) files clean"

#!/usr/bin/env bash
# Fails when a source folder's README leaves out one of the files directly in it. A file counts as listed
# when the README names it in backticks (`x.cpp`), or names its stem with any extension (`x.*`).
# Usage: readmes_check.sh [ROOT] (the repository by default; tests/readmes_test.sh also runs it on a tree
# that breaks it).
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
bad=0
# Every top-level folder that holds C++ sources, as tests/floors_check.sh finds them; tests/ maps itself by
# mirroring the others.
for dir in */; do
  folder=${dir%/}
  case $folder in tests | build*) continue ;; esac
  [ -n "$(find "$folder" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) -print -quit)" ] || continue
  if [ ! -f "$folder/README.md" ]; then
    echo "$folder/: no README.md"
    bad=1
    continue
  fi
  for path in "$folder"/*; do
    [ -f "$path" ] || continue
    f=$(basename "$path")
    case $f in README.md | CMakeLists.txt) continue ;; esac
    stem=${f%.*}
    if ! grep -qF "\`$f\`" "$folder/README.md" && ! grep -qF "\`$stem.*\`" "$folder/README.md"; then
      echo "$folder/README.md does not list $f"
      bad=1
    fi
  done
done
[ "$bad" = 0 ] && echo "readmes: every source file is listed"
exit "$bad"

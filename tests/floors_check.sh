#!/usr/bin/env bash
# Fails when an include climbs a floor. The source folders stand on floors, top to bottom:
#
#   apps, tests                  main()s and checks: may include any folder
#   trainer                      the RL loops, the run and its plumbing
#   parallel                     collectives, launch, sharding, AdamW, weight transfer, placement
#   rollout                      sampler, decode engine, the ReTool loop, the sandbox
#   data | model | loss          side by side: none includes another
#   common                       what every folder shares
#
# A file may include its own folder and any folder on a lower floor, never one above it or beside it
# (model never sees loss, loss sees tensors only). The table below is the rule; the README's layout
# section draws it.
# Usage: floors_check.sh [ROOT] (the repository by default; the test also runs it on a tree that breaks it).
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

declare -A allowed=(
  [common]="common"
  [loss]="loss common"
  [model]="model common"
  [data]="data common"
  [rollout]="rollout data model loss common"
  [parallel]="parallel rollout data model loss common"
  [trainer]="trainer parallel rollout data model loss common"
)

bad=0
checked=0
for folder in "${!allowed[@]}"; do
  [ -d "$folder" ] || continue
  while IFS= read -r file; do
    checked=$((checked + 1))
    while IFS=: read -r line target; do
      ok=0
      for a in ${allowed[$folder]}; do [ "$target" = "$a" ] && ok=1; done
      if [ "$ok" = 0 ]; then
        echo "$file:$line: includes $target/, which $folder/ may not (it may include: ${allowed[$folder]})"
        bad=1
      fi
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[A-Za-z_]+/' "$file" |
               sed -E 's/^([0-9]+):[^"]*"([A-Za-z_]+)\/.*/\1:\2/')
  done < <(find "$folder" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \))
done

# A folder that holds sources but has no floor is a new room: give it one above.
for dir in */; do
  folder=${dir%/}
  case $folder in apps | tests | build* | scripts | docs | configs | examples) continue ;; esac
  [ -n "${allowed[$folder]+x}" ] && continue
  if [ -n "$(find "$folder" -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) -print -quit)" ]; then
    echo "$folder/: holds C++ sources but has no floor in tests/floors_check.sh"
    bad=1
  fi
done

[ "$bad" = 0 ] && echo "floors: $checked files, no include climbs a floor"
exit "$bad"

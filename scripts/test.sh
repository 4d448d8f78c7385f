#!/usr/bin/env bash
# The README's test command: installs what is missing, configures, builds, runs every test (ctest), and
# checks that no tracked file tells the project's history (session, call or issue numbers: git log
# holds the history). The history check runs first but fails the script only after ctest has run.
set -euo pipefail
cd "$(dirname "$0")/.."

# The pattern is assembled from pieces so that this file does not match it.
n='[0-9]'
history_pattern="[Ss]ession ?$n|\\bcall $n|issue $n"
history=0
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  found=$(mktemp)
  rc=0
  git grep -nE "$history_pattern" > "$found" || rc=$?
  case $rc in
    0) echo "history check: these lines name a session, call or issue; describe the code as it is:"
       head -n 40 "$found"
       echo "($(wc -l < "$found") lines: git grep -nE '$history_pattern')"
       history=1 ;;
    1) echo "history check: clean" ;;
    *) echo "history check: git grep failed ($rc)"; history=1 ;;
  esac
  rm -f "$found"
else
  echo "history check: skipped (not a git checkout)"
fi

RLT_SETUP_TESTS=1 bash scripts/setup.sh "$@"
ctest --test-dir build --output-on-failure -j "$(nproc)"
exit "$history"

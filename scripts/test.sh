#!/usr/bin/env bash
# The README's test command: installs what is missing, configures, builds, runs every test (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "$@"
ctest --test-dir build --output-on-failure -j "$(nproc)"

#!/usr/bin/env bash
# The floors check on the repository, and on small trees it must reject: an include that climbs a floor,
# one that reaches a folder beside its own, and a source folder with no floor. A check that passed those
# would pass anything.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/floors_check.sh" "$here/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
expect_rejected() {  # name, then file=content pairs making the tree
  local name=$1 root="$tmp/$1"
  shift
  for pair in "$@"; do
    mkdir -p "$root/$(dirname "${pair%%=*}")"
    printf '%s\n' "${pair#*=}" > "$root/${pair%%=*}"
  done
  if bash "$here/floors_check.sh" "$root" > "$root.out" 2>&1; then
    echo "floors check passed a tree it must reject ($name):"; cat "$root.out"; exit 1
  fi
  echo "rejected ($name): $(head -n 1 "$root.out")"
}
expect_rejected climbs 'model/a.h=#include "common/x.h"' 'model/b.cpp=#include "trainer/run.h"'
expect_rejected beside 'loss/a.cpp=#include "model/transformer.h"'
expect_rejected parallel_up 'parallel/shard.cpp=  #  include "trainer/run.h"'
expect_rejected no_floor 'engine/a.cpp=#include "common/x.h"'
# And a tree that keeps the rules passes, so the rejections above are the rules' doing.
mkdir -p "$tmp/good/trainer" "$tmp/good/parallel"
printf '#include "parallel/shard.h"\n#include "common/x.h"\n' > "$tmp/good/trainer/a.cpp"
printf '#include "model/transformer.h"\n' > "$tmp/good/parallel/b.cpp"
bash "$here/floors_check.sh" "$tmp/good"

#!/usr/bin/env bash
# Configures and builds the project into build-gpu/ on a GPU host that has CUDA (nvcc), CMake, ninja and
# a python3 with torch 2.11, but no package registry. What it lacks comes from .gpu/ (made by
# scripts/gpu/fetch_deps.sh on a connected machine):
#   - the Debian packages in .gpu/debs are unpacked with dpkg -x into $RLT_DEPS_DIR (default
#     build-gpu/deps; nothing is installed into /), once; without .gpu/debs the system's packages are
#     used (a host where scripts/setup.sh installed them);
#   - the nvidia-cutlass wheel in .gpu/wheels is unzipped there for the fused CCE kernels' headers;
#   - the HF fixtures ($RLT_FIXTURES_DIR, else .gpu/fixtures when present) go to the tests.
# LibTorch comes from torch.utils.cmake_prefix_path. The CUDA target is sm_90a (Hopper) unless
# CMAKE_CUDA_ARCHITECTURES is passed. The source tree is the current directory, so an older tree can be
# built with this tree's deps: (cd /tmp/old && bash /path/to/scripts/gpu/deps_build.sh).
# Usage (repository root): bash scripts/gpu/deps_build.sh [extra cmake args...]
# The binaries need the unpacked libraries: LD_LIBRARY_PATH=build-gpu/deps/usr/lib/x86_64-linux-gnu.
set -euo pipefail
tree=$(cd "$(dirname "$0")/../.." && pwd)  # the tree that holds .gpu/
gpu=$tree/.gpu
deps=${RLT_DEPS_DIR:-$tree/build-gpu/deps}
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
py=${PYTHON:-python3}

if ls "$gpu"/debs/*.deb > /dev/null 2>&1; then
  if [ ! -d "$deps/usr/include/yaml-cpp" ]; then
    mkdir -p "$deps"
    for f in "$gpu"/debs/*.deb; do dpkg -x "$f" "$deps"; done
  fi
elif ! dpkg -s libyaml-cpp-dev > /dev/null 2>&1; then
  echo "deps_build: no $gpu/debs and no system yaml-cpp: run scripts/setup.sh (with a package registry)" \
       "or carry .gpu/ from scripts/gpu/fetch_deps.sh" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$deps/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

args=()
cutlass_whl=$(ls "$gpu"/wheels/nvidia_cutlass-4.2.0.0-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$cutlass_whl" ]; then
  inc=$deps/cutlass/cutlass_library/source/include
  [ -f "$inc/cute/tensor.hpp" ] || "$py" -m zipfile -e "$cutlass_whl" "$deps/cutlass"
  args+=(-DRLT_CUTLASS_DIR="$inc")
fi
fixtures=${RLT_FIXTURES_DIR:-$gpu/fixtures}
[ -d "$fixtures/tokenizers" ] && args+=(-DRLT_FIXTURES_DIR="$fixtures")

torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" \
  -DCMAKE_INCLUDE_PATH="$deps/usr/include" \
  -DCMAKE_LIBRARY_PATH="$deps/usr/lib/$multiarch" \
  -DPython3_EXECUTABLE="$(command -v "$py")" \
  -DCMAKE_CUDA_ARCHITECTURES=90a "${args[@]}" "$@"
# RLT_BUILD_TARGETS: only these targets (a benchmark that needs one app builds in half the time).
cmake --build build-gpu -j "$(nproc)" ${RLT_BUILD_TARGETS:+--target $RLT_BUILD_TARGETS}
echo "deps_build: built build-gpu/ (run its binaries with LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"

#!/usr/bin/env bash
# Downloads what a GPU host without a package registry needs to build this project, into .gpu/ (git
# ignores it), so that the folder can travel with the working tree. Run it from the repository root on a
# Debian/Ubuntu machine that reaches apt and PyPI, ideally of the host's release. The GPU host itself must
# have CUDA (nvcc), CMake, ninja and a python3 with torch 2.11 (LibTorch comes from that wheel).
#   .gpu/debs/     the -dev packages of yaml-cpp, sentencepiece, Eigen, GoogleTest, nlohmann-json, CLI11,
#                  libseccomp, PCRE2 and utf8proc, their shared libraries, and bubblewrap (the sandbox
#                  benchmark's peer row)
#   .gpu/wheels/   nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe headers of the fused CCE kernels), and
#                  cut-cross-entropy + liger-kernel (the fused peers of scripts/gpu/bench_loss.sh)
#   .gpu/fixtures/ a copy of the HF fixtures (tokenizers/, templates/, data/) when RLT_FIXTURES_DIR names
#                  them: the tests that read published tokenizer files and the GPU recipes use it
# Usage: [RLT_FIXTURES_DIR=/path/to/hf] [NO_PEERS=1] bash scripts/gpu/fetch_deps.sh
# Then on the GPU host: bash scripts/gpu/deps_build.sh (scripts/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/debs .gpu/wheels

dev=(libyaml-cpp-dev libsentencepiece-dev libeigen3-dev libgtest-dev libgmock-dev nlohmann-json3-dev
     libcli11-dev libseccomp-dev libpcre2-dev libutf8proc-dev bubblewrap)
# A -dev package's own shared libraries (libyaml-cpp0.7, libpcre2-8-0, ...) have release-dependent
# names: read them from its dependencies. The C/C++ runtime and the base system are on every host.
base="^(libc6|libgcc-s1|libstdc\+\+6|libc-dev|libcap2|libselinux1|pkg-config|googletest)$"
[ -n "$(ls /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial -e auxfiles)" ] || apt-get update -qq
pkgs=("${dev[@]}")
for p in "${dev[@]}"; do
  while read -r dep; do
    [[ "$dep" =~ $base ]] || pkgs+=("$dep")
  done < <(apt-cache depends --no-recommends --no-suggests "$p" | awk '$1 == "Depends:" && $2 !~ /^</ {print $2}')
done
mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | sort -u)
(cd .gpu/debs && apt-get download -qq "${pkgs[@]}" 2> >(grep -v unsandboxed >&2))
echo "fetch_deps: ${#pkgs[@]} Debian packages in .gpu/debs"

py=${PYTHON:-python3}
wheels=(nvidia-cutlass==4.2.0.0)
[ "${NO_PEERS:-0}" = 1 ] || wheels+=(cut-cross-entropy liger-kernel)
"$py" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "${wheels[@]}"
# The end-to-end peer (e2e_peer.sh): TRL and what of its needs the host's Python (3.12) lacks.
[ "${NO_PEERS:-0}" = 1 ] || "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  -d .gpu/wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
echo "fetch_deps: wheels in .gpu/wheels: $(ls .gpu/wheels | tr '\n' ' ')"

if [ -n "${RLT_FIXTURES_DIR:-}" ]; then
  [ -d "$RLT_FIXTURES_DIR/tokenizers" ] || { echo "fetch_deps: $RLT_FIXTURES_DIR has no tokenizers/" >&2; exit 1; }
  mkdir -p .gpu/fixtures
  cp -r "$RLT_FIXTURES_DIR"/. .gpu/fixtures/
  chmod -R u+w .gpu/fixtures
  echo "fetch_deps: fixtures copied from $RLT_FIXTURES_DIR into .gpu/fixtures"
fi
du -sh .gpu/debs .gpu/wheels .gpu/fixtures 2>/dev/null || true

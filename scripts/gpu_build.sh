# Sourced by the scripts/gpu_*.sh scripts on the GPU host, with $out set (and the hf fixtures copied into
# .gpu/fixtures: cp -r ../shared/fixtures/hf/* .gpu/fixtures/; besides the Debian packages that
# ../shared/gpu/fetch-debs.sh downloads, data/ needs PCRE2 and utf8proc: from .gpu/debs,
# apt-get download libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc-dev
# libutf8proc2): builds into build-gpu/ with
# .gpu/build.sh (the log goes to $out/build.log; on failure its tail is printed and the caller exits),
# then exports what the binaries and the Python peers need.
export PYTHONUNBUFFERED=1
if [ ! -x build-gpu/bin/grpo_train ] || [ "${GPU_REBUILD:-1}" = 1 ]; then
  # The hf fixtures travel in .gpu/fixtures (../shared does not reach the GPU host).
  # CUTLASS/CuTe headers for the fused CCE kernels: the nvidia-cutlass wheel carried in .gpu/wheels
  # (pip download --no-deps nvidia-cutlass==4.2.0.0 -d .gpu/wheels).
  cutlass_args=()
  cutlass_whl=$(ls .gpu/wheels/nvidia_cutlass-4.2.0.0-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$cutlass_whl" ]; then
    [ -f /tmp/rlt_cutlass/cutlass_library/source/include/cute/tensor.hpp ] ||
      python3 -m zipfile -e "$cutlass_whl" /tmp/rlt_cutlass
    cutlass_args=(-DRLT_CUTLASS_DIR=/tmp/rlt_cutlass/cutlass_library/source/include)
  fi
  if ! bash .gpu/build.sh -DRLT_FIXTURES_DIR="$PWD/.gpu/fixtures" "${cutlass_args[@]}" > "$out/build.log" 2>&1; then
    tail -n 60 "$out/build.log"
    exit 1
  fi
fi
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# Every test on the GPU host (ctest runs the fixtures that make the transformers references, CUDA ones
# included), logged to $out/ctest.log. Fails (returns 1) when a test fails or when a CUDA test was skipped:
# on a machine with a GPU a skipped CUDA test is a test that did not run.
run_gpu_ctest() {
  (cd build-gpu && ctest --output-on-failure -j 8) > "$out/ctest.log" 2>&1
  local rc=$?
  echo "ctest rc=$rc ($(grep -E 'tests passed|tests failed' "$out/ctest.log"))"
  grep -E "^ *[0-9]+/[0-9]+ Test .*(Failed|\*\*\*)" "$out/ctest.log" | head -20
  local skipped
  # A CUDA test (its name says Cuda/cuda/Gpu) that skipped did not run; host-dependent skips (a sandbox
  # isolation level the host lacks) are reported, not failed.
  grep -E "^ *[0-9]+/[0-9]+ Test .*Skipped" "$out/ctest.log" | head -20
  skipped=$(grep -E "^ *[0-9]+/[0-9]+ Test .*Skipped" "$out/ctest.log" | grep -cE "Cuda|cuda|CUDA|Gpu|_gpu|Bf16")
  if [ "$skipped" -gt 0 ]; then
    echo "ctest: $skipped CUDA test(s) skipped on a GPU host: each must run here"
    return 1
  fi
  return $rc
}

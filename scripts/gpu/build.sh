# Sourced by the scripts/gpu/*.sh recipes on the GPU host, with $out set: builds into build-gpu/ with
# scripts/gpu/deps_build.sh (the log goes to $out/build.log; on failure its tail is printed and the
# caller exits), then exports what the binaries and the Python peers need. GPU_REBUILD=0 keeps an
# existing build-gpu/. RLT_FIXTURES_DIR (default .gpu/fixtures) is the HF fixtures folder.
export PYTHONUNBUFFERED=1
mkdir -p "$out"
export RLT_FIXTURES_DIR=${RLT_FIXTURES_DIR:-$PWD/.gpu/fixtures}
if [ ! -x build-gpu/bin/grpo_train ] || [ "${GPU_REBUILD:-1}" = 1 ]; then
  if ! bash scripts/gpu/deps_build.sh > "$out/build.log" 2>&1; then
    tail -n 60 "$out/build.log"
    exit 1
  fi
fi
export LD_LIBRARY_PATH=${RLT_DEPS_DIR:-$PWD/build-gpu/deps}/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

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

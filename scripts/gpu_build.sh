# Sourced by the scripts/gpu_*.sh scripts on the GPU host, with $out set: builds into build-gpu/ with
# .gpu/build.sh (the log goes to $out/build.log; on failure its tail is printed and the caller exits),
# then exports what the binaries and the Python peers need.
export PYTHONUNBUFFERED=1
if [ ! -x build-gpu/bin/grpo_train ] || [ "${GPU_REBUILD:-1}" = 1 ]; then
  if ! bash .gpu/build.sh > "$out/build.log" 2>&1; then
    tail -n 60 "$out/build.log"
    exit 1
  fi
fi
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks (idempotently: nothing is fetched twice), then configures
# build/ and builds the trainers and the tools a first run uses (grpo_train, ppo_train, tokenize,
# chat_template, score in build/bin/), so the demo starts sooner; without a visible GPU, without the CUDA
# kernels (the test command's setup turns them back on, which rebuilds what links them). RLT_SETUP_TESTS=1 (scripts/test.sh sets it) also installs the tests' Python references and
# builds every target, tests included.
#   Debian packages: cmake, ninja, yaml-cpp, sentencepiece, Eigen, GoogleTest, nlohmann-json, CLI11, libseccomp,
#                    PCRE2 + utf8proc (tokenizer.json regexes and NFC), bubblewrap
#   PyPI:            torch==2.11.0, whose LibTorch (share/cmake) we link; the GPU host has the same one;
#                    nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe headers of the fused CCE kernels)
#   PyPI, tests:     transformers, safetensors, peft, tokenizers, sentencepiece, jinja2, pyarrow, tensorboard
# Usage: bash scripts/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake ninja-build g++ python3 clang-format libyaml-cpp-dev libsentencepiece-dev libeigen3-dev libgtest-dev
      libgmock-dev nlohmann-json3-dev libcli11-dev libseccomp-dev libpcre2-dev libutf8proc-dev bubblewrap)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# The Python that holds torch: an existing one, else pip into it, else a project venv (PEP 668 systems).
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
has_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' 2>/dev/null; }
if ! has_torch "$py"; then
  echo "setup: installing torch==2.11.0 from PyPI (LibTorch comes from this wheel)"
  if ! "$py" -m pip install -q torch==2.11.0; then
    python3 -m venv .venv && py=.venv/bin/python && "$py" -m pip install -q torch==2.11.0
  fi
fi
tests=${RLT_SETUP_TESTS:-0}
# transformers makes the reference checkpoints the model tests compare against (tests/model/).
if [ "$tests" = 1 ] && ! "$py" -c 'import transformers, safetensors, sys; sys.exit(0 if transformers.__version__ == "5.17.0" else 1)' 2>/dev/null; then
  echo "setup: installing transformers==5.17.0 safetensors (reference models for the tests)"
  "$py" -m pip install -q transformers==5.17.0 safetensors
fi
# peft loads the trainer's LoRA adapter folders onto the reference checkpoints (tests/model/check_peft.py).
if [ "$tests" = 1 ] && ! "$py" -c 'import peft, sys; sys.exit(0 if peft.__version__ == "0.21.2" else 1)' 2>/dev/null; then
  echo "setup: installing peft==0.21.2 (loads our LoRA adapter folders in the tests)"
  "$py" -m pip install -q peft==0.21.2
fi
# The independent references of the data tests: HF tokenizers and sentencepiece (tokenizer parity), jinja2
# (transformers' apply_chat_template renders with it), pyarrow (parquet datasets).
if [ "$tests" = 1 ] && ! "$py" -c 'import tokenizers, sentencepiece, jinja2, pyarrow, sys; sys.exit(0 if tokenizers.__version__ == "0.23.3" else 1)' 2>/dev/null; then
  echo "setup: installing tokenizers==0.23.3 sentencepiece jinja2 pyarrow (references for the tokenizer and chat-template tests)"
  "$py" -m pip install -q tokenizers==0.23.3 sentencepiece jinja2 pyarrow
fi
# tensorboard: the reference writer and reader of the trainer's event files (tests/common/, tests/apps/).
if [ "$tests" = 1 ] && ! "$py" -c 'import tensorboard, sys; sys.exit(0 if tensorboard.__version__ == "2.20.0" else 1)' 2>/dev/null; then
  echo "setup: installing tensorboard==2.20.0 (reads and writes the event files the trainer's are compared with)"
  "$py" -m pip install -q tensorboard==2.20.0
fi
# CUTLASS/CuTe headers for the fused Hopper CCE kernels (loss/cuda/cce_fused.cu): the pinned wheel.
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("nvidia-cutlass") == "4.2.0.0" else 1)' 2>/dev/null; then
  echo "setup: installing nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe headers for the fused CCE kernels)"
  "$py" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
fi
torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null | tail -n1)

# The CUDA kernels compile wherever nvcc is found, and the tests build them (they must compile on a
# machine without a GPU too); the demo's build leaves them out where no GPU is visible, since they could
# not run there: a quarter of its compile time. Extra arguments come last and may say otherwise.
cuda=ON
gpus=$(nvidia-smi -L 2>/dev/null || true)
if [ "$tests" != 1 ] && ! grep -q "^GPU" <<< "$gpus"; then cuda=OFF; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" -DRLT_WITH_CUDA=$cuda \
  -DPython3_EXECUTABLE="$("$py" -c 'import sys; print(sys.executable)')" "$@"
if [ "$tests" = 1 ]; then
  cmake --build build -j "$(nproc)"
else
  # The trainers and the README's look-before-you-train tools; `cmake --build build` builds the benchmarks,
  # scripts/test.sh everything.
  cmake --build build -j "$(nproc)" --target grpo_train ppo_train tokenize chat_template score
fi

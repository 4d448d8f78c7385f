#!/usr/bin/env bash
# The end-to-end peer on one GPU, one command: grpo_train --config configs/retool.yaml with tools off beside
# TRL's GRPOTrainer (scripts/bench_grpo_peer.py, transformers generate), on the same random
# Qwen2.5-0.5B-shaped checkpoint (scripts/gpu/random_qwen.sh), the same prompts rendered by the same chat
# template, G, max new tokens, optimizer and loss settings; TRL takes MICRO sequences a micro-batch, ours the
# recipe's packed token-budget micro-batches (OURS_MICRO=n: n padded sequences a micro-batch instead). Per
# run: the steady-state step time and sampled tokens/s (the mean over the steps after the first), and the
# GPU's peak memory.used (nvidia-smi, sampled every 100 ms: the whole process, caching allocator and CUDA
# context included, the same reading for both). summary.json holds both sides and the ratios; raw.tgz the logs, metrics and
# memory samples.
#
# Needs the wheels of TRL and of its dependencies the host lacks in .gpu/wheels, installed into /tmp/site;
# the host has pyarrow, pandas, xxhash, fsspec, accelerate and transformers. On a machine with PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/wheels \
#     trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# Environment (defaults: configs/retool.yaml's step shape):
#   PROMPTS=32 SAMPLES=8 NEW_TOKENS=512 MICRO=8 STEPS=3   prompts a step, G, max new tokens, TRL's micro-batch,
#                  steps
#   DATA=data/dapo-math-17k-200.jsonl ANSWER_KEY=label    the prompts and their answer key
#   CKPT=dir       a checkpoint folder instead of the random one (a Qwen/Llama HF folder with its tokenizer)
#   ASYNC=1        also ours with --set train.async=one_step
#   PARTIAL=1      also ours with train.async one_step and --set rollout.partial=true
#   OURS_SET="--set k=v ..."   extra settings for every run of ours; PEER_ARGS="..." extra bench_grpo_peer.py
#                  arguments for every TRL run
#   TRL=0          skip TRL; TRL_BF16=1 also runs TRL with bf16 weights and AdamW states (--dtype bfloat16)
#   OURS_TIMEOUT=300 TRL_TIMEOUT=360   seconds each run may take; GPU=0 the GPU used
# Usage: OUT=... bash scripts/gpu/e2e_peer.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-runs/gpu_e2e_peer}
prompts=${PROMPTS:-32}
samples=${SAMPLES:-8}
new_tokens=${NEW_TOKENS:-512}
micro=${MICRO:-8}
steps=${STEPS:-3}
data=${DATA:-data/dapo-math-17k-200.jsonl}
answer_key=${ANSWER_KEY:-label}
gpu=${GPU:-0}
# retool.yaml's system turn names the interpreter; with tools off both sides get this one.
system='Solve the math problem step by step. Put the final answer as \boxed{...}.'
mkdir -p "$out/raw"
export CUDA_VISIBLE_DEVICES=$gpu NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
start=$(date +%s)

# 1. TRL and the dependencies the host lacks, from carried wheels; their versions and the host's.
if [ "${TRL:-1}" = 1 ]; then
  wheels=()
  for name in trl datasets dill multiprocess; do
    w=$(ls .gpu/wheels/"$name"-*.whl 2>/dev/null | head -n1)
    [ -n "$w" ] || { echo "e2e_peer: no .gpu/wheels/$name-*.whl (this script's header: pip download)"; exit 1; }
    wheels+=("$w")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 - > "$out/versions.txt" 2>&1 <<'PY' || { cat "$out/versions.txt"; exit 1; }
import importlib, importlib.metadata, sys
print("python", sys.version.split()[0])
for m in ["torch", "transformers", "accelerate", "trl", "datasets", "pyarrow", "pandas", "fsspec", "dill",
          "multiprocess", "xxhash", "huggingface_hub", "tokenizers"]:
    importlib.import_module(m)
    print(m, importlib.metadata.version(m))
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  fails here, before the build, when TRL cannot load
PY
  cat "$out/versions.txt"
fi

# 2. grpo_train, and the checkpoint ($ckpt; random_qwen.sh also writes $out/math.jsonl, unused here).
export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-grpo_train}
source scripts/gpu/build.sh
echo "build done at $(($(date +%s) - start)) s"
if [ -n "${CKPT:-}" ]; then
  ckpt=$CKPT
else
  source scripts/gpu/random_qwen.sh
  rm -f "$out/math.jsonl"
fi
nvidia-smi -i "$gpu" --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits > "$out/raw/idle_mib.txt" 2>&1

# measure NAME TIMEOUT CMD...: one run, its GPU memory.used sampled every 100 ms, exit code and wall time.
measure() {
  local name=$1 limit=$2
  shift 2
  nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/raw/mem_$name.csv" &
  local watcher=$! t0
  t0=$(date +%s%N)
  timeout "$limit" "$@" > "$out/raw/$name.log" 2>&1
  echo $? > "$out/raw/$name.rc"
  awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f\n", (b - a) / 1e9 }' > "$out/raw/$name.wall"
  kill $watcher
  echo "$name: exit $(cat "$out/raw/$name.rc"), wall $(cat "$out/raw/$name.wall") s"
  tail -n 4 "$out/raw/$name.log"
}

# 3. Ours: configs/retool.yaml, tools off, the boxed reward, no evaluation, the step shape above.
ours=(build-gpu/bin/grpo_train --config configs/retool.yaml --set model.path="$ckpt" --set data.path="$data"
      --set data.answer_key="$answer_key" --set rollout.tools=false --set reward.kind=boxed
      --set "chat.system=$system" --set sampling.max_new_tokens="$new_tokens"
      --set sampling.samples_per_prompt="$samples" --set train.prompts_per_step="$prompts"
      --set train.steps="$steps" --set train.checkpoint_every=0
      --set data.eval_path= --set train.eval_prompts=0)
if [ -n "${OURS_MICRO:-}" ]; then
  ours+=(--set train.micro_batch_size="$OURS_MICRO" --set train.micro_batch_tokens=0 --set train.pack_sequences=false)
fi
# shellcheck disable=SC2206  # OURS_SET and PEER_ARGS are lists of words
extra=(${OURS_SET:-}) peer_extra=(${PEER_ARGS:-})
runs=(ours_sync)
measure ours_sync "${OURS_TIMEOUT:-300}" "${ours[@]}" "${extra[@]}" --out "$out/ours_sync"
if [ "${ASYNC:-0}" = 1 ]; then
  runs+=(ours_async)
  measure ours_async "${OURS_TIMEOUT:-300}" "${ours[@]}" "${extra[@]}" --set train.async=one_step \
    --out "$out/ours_async"
fi
if [ "${PARTIAL:-0}" = 1 ]; then
  runs+=(ours_partial)
  measure ours_partial "${OURS_TIMEOUT:-300}" "${ours[@]}" "${extra[@]}" --set train.async=one_step \
    --set rollout.partial=true --out "$out/ours_partial"
fi
for r in ours_sync ours_async ours_partial; do
  cp "$out/$r/metrics.jsonl" "$out/raw/metrics_$r.jsonl" 2>/dev/null
  rm -rf "${out:?}/$r"  # its end-of-run checkpoint
done

# 4. TRL on the same checkpoint and prompts.
peer=(python3 scripts/bench_grpo_peer.py --model "$ckpt" --data "$data" --answer-key "$answer_key"
      --system "$system" --steps "$steps" --prompts-per-step "$prompts" --samples "$samples"
      --max-new-tokens "$new_tokens" --micro-batch "$micro" "${peer_extra[@]}")
if [ "${TRL:-1}" = 1 ]; then
  runs+=(trl)
  measure trl "${TRL_TIMEOUT:-360}" "${peer[@]}" --json "$out/raw/trl.json"
  if [ "${TRL_BF16:-0}" = 1 ]; then
    runs+=(trl_bf16)
    measure trl_bf16 "${TRL_TIMEOUT:-360}" "${peer[@]}" --dtype bfloat16 --json "$out/raw/trl_bf16.json"
  fi
fi

# 5. summary.json: each run's steady-state means (steps after the first), its peak memory, and the ratios.
python3 - "$out" "$steps" "${runs[@]}" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
raw = f"{out}/raw"
def number(text):
    try:
        return float(text)
    except ValueError:
        return None
idle = number(open(f"{raw}/idle_mib.txt").read().strip())  # None: nvidia-smi gave no reading
res = {}
for name in names:
    r = {"exit": int(open(f"{raw}/{name}.rc").read()), "wall_s": float(open(f"{raw}/{name}.wall").read())}
    mem = [v for v in map(number, open(f"{raw}/mem_{name}.csv").read().split()) if v is not None]
    r["gpu_peak_mib"] = max(mem, default=None)
    r["gpu_peak_over_idle_mib"] = r["gpu_peak_mib"] - idle if mem and idle is not None else None
    if name.startswith("ours"):
        path = f"{raw}/metrics_{name}.jsonl"
        rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
        steady = rows[1:] or rows  # the first step warms up (CUDA graphs, plans, allocator)
        r["steps_run"] = len(rows)
        for k in sorted({k for row in steady for k, v in row.items() if isinstance(v, (int, float))}):
            vals = [row[k] for row in steady if isinstance(row.get(k), (int, float))]
            r[k] = sum(vals) / len(vals)
        if "sampled_tokens" in r:
            r["sampled_tokens_per_s"] = r["sampled_tokens"] / r["time_step_s"]
    else:
        path = f"{raw}/{name}.json"
        if os.path.exists(path):
            trl = json.load(open(path))
            r["steps_run"] = len(trl["steps"])
            r.update({k: v for k, v in trl["steady"].items() if v is not None})
            r["versions"], r["weights_dtype"] = trl["versions"], trl["weights_dtype"]
    r["log_tail"] = open(f"{raw}/{name}.log", errors="replace").read().splitlines()[-15:]
    res[name] = r

def ratio(a, b):
    return a / b if a and b else None

table = []
for name, r in res.items():
    r["ok"] = ok = r["exit"] == 0 and r.get("steps_run") == steps
    # ours: time_rollout_s; TRL: time_generate_s (until its reward function is called)
    gen = r.get("time_rollout_s", r.get("time_generate_s"))
    table.append({"run": name, "ok": ok, "step_s": r.get("time_step_s"), "generate_s": gen,
                  "sampled_tokens_per_s": r.get("sampled_tokens_per_s"), "gpu_peak_mib": r.get("gpu_peak_mib")})
summary = {"runs": res, "table": table, "idle_gpu_mib": idle, "steady_steps": f"2..{steps}"}
# Ratios only between runs that finished every step.
for peer in [n for n in res if n.startswith("trl") and res[n]["ok"]]:
    p = res[peer]
    for ours in [n for n in res if n.startswith("ours") and res[n]["ok"]]:
        o = res[ours]
        summary[f"{peer}_over_{ours}"] = {
            "step_time": ratio(p.get("time_step_s"), o.get("time_step_s")),  # > 1: ours is faster
            "sampled_tokens_per_s": ratio(o.get("sampled_tokens_per_s"), p.get("sampled_tokens_per_s")),  # ours / peer
            "gpu_peak": ratio(p.get("gpu_peak_mib"), o.get("gpu_peak_mib")),  # > 1: ours takes less
        }
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
for row in table:
    print(json.dumps(row))
for k, v in summary.items():
    if "_over_" in k:
        print(k, json.dumps(v))
PY
(cd "$out" && tar czf raw.tgz --remove-files raw)
echo "e2e_peer: done in $(($(date +%s) - start)) s"

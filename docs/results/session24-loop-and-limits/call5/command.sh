set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
run_gpu_ctest; echo "ctest rc=$?"
# issue 15, selective log-softmax: its times beside the HBM rates of a plain read and a plain copy of the same bytes
build-gpu/bin/bench_loss --device cuda --case seed000 --impl selective selective_inplace --reps 20 --json "$out/seed000.json" 2>&1 | tee "$out/selective.log"
python3 - <<'PY' 2>&1 | tee -a "$out/selective.log"
import torch
x = torch.randn(16384, 32768, device="cuda")  # seed000's fp32 logits, 2 GiB
y = torch.empty_like(x)
def t(fn, reps=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]
gib = x.numel() * 4
r = t(lambda: x.amax())  # one read
c = t(lambda: y.copy_(x))  # one read, one write
i = t(lambda: x.mul_(1.0))  # in place: one read, one write of the same buffer
print(f"read 2 GiB (amax): {r:.4f} ms, {gib / r / 1e9:.2f} TB/s")
print(f"copy 2 GiB (read + write): {c:.4f} ms, {2 * gib / c / 1e9:.2f} TB/s")
print(f"in-place scale 2 GiB (read + write): {i:.4f} ms, {2 * gib / i / 1e9:.2f} TB/s")
print(f"selective fw+bw bound at these rates: read {r:.4f} + in-place {i:.4f} = {r + i:.4f} ms")
PY
grep -E "Failed|\*\*\*Failed" "$out/ctest.log" | head

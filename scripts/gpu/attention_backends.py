"""ATen's two variable-length attention forwards on the GPU host, bf16, causal: FA2's
(aten._flash_attention_forward, what packed forwards call) against cuDNN's (aten._cudnn_attention_forward
given cumulative sequence lengths), keys and values with fewer heads (GQA) and repeated to every head. Per
shape: ms a call (mean of 20 after 3), TFLOP/s of the causal products, and cuDNN's largest difference from
FA2's output. Usage: python3 scripts/gpu/attention_backends.py"""
import time

import torch

SHAPES = [  # name, sequence lengths, heads, KV heads, head dim
    ("reward model, 0.5B: 256 x 690", [690] * 256, 14, 2, 64),
    ("update, 0.5B: 64 x 1,024", [1024] * 64, 14, 2, 64),
    ("update, 7B: 64 x 1,024", [1024] * 64, 28, 4, 128),
    ("0.5B, 200 of 100-1,500", torch.randint(100, 1500, (200,), generator=torch.Generator().manual_seed(0)).tolist(),
     14, 2, 64),
]


def ms_a_call(f, n=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


torch.manual_seed(0)
for name, lens, H, Hkv, hd in SHAPES:
    T, longest = sum(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(T, H, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hkv, hd, device="cuda", dtype=torch.bfloat16)
    flops = sum(2 * n * n * hd * H for n in lens)  # QK^T and PV over the causal half
    scale = hd ** -0.5
    fa2 = lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                          scale=scale)[0]
    want = fa2()
    row = {"fa2": ms_a_call(fa2)}
    diffs = {}
    for form, (kk, vv) in {"cudnn_gqa": (k, v), "cudnn_repeated": (k.repeat_interleave(H // Hkv, 1),
                                                                   v.repeat_interleave(H // Hkv, 1))}.items():
        cudnn = lambda: torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, longest, longest, False, 0.0,
                                                                True, False, scale=scale)[0]
        try:
            diffs[form] = (cudnn().float() - want.float()).abs().max().item()
            row[form] = ms_a_call(cudnn)
        except RuntimeError as e:
            diffs[form] = str(e).splitlines()[0][:120]
    print(f"{name}: " + ", ".join(f"{k} {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)" for k, t in row.items()) +
          f"; cuDNN's largest difference from FA2: {diffs}", flush=True)

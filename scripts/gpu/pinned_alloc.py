# Seconds to pin host memory with torch on the GPU host: 4 GB as one buffer or split over threads, through
# the caching host allocator's default (cudaHostAlloc), then with PYTORCH_CUDA_ALLOC_CONF's
# pinned_use_cuda_host_register (malloc, then cudaHostRegister by pinned_num_register_threads threads), as
# the trainers set it. Usage: python3 scripts/gpu/pinned_alloc.py (it runs itself again for the second).
import os
import subprocess
import sys
import threading
import time

import torch

GB = 1 << 30


def pin(gigabytes, parts):
    out = [None] * parts

    def one(i):
        torch.cuda.set_device(0)
        out[i] = torch.empty(int(gigabytes * GB / parts) // 4, dtype=torch.float32, pin_memory=True)

    t = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(parts)]
    for x in threads:
        x.start()
    for x in threads:
        x.join()
    return time.time() - t


if __name__ == "__main__":
    torch.zeros(1, device="cuda")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default (cudaHostAlloc)")
    for parts in (1, 4, 8, 16):
        dt = pin(4, parts)  # each size its own power-of-two bin: nothing reused from the cache
        print(f"{conf}: 4 GB in {parts} thread(s) {dt:.2f} s ({4 / dt:.1f} GB/s)", flush=True)
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
        sys.exit(subprocess.call([sys.executable, __file__], env=env))

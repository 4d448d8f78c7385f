set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
export PATH=$PATH:/usr/local/cuda/bin
timeout 240 ncu --set full -k regex:cce_sparse --launch-skip 40 --launch-count 2 \
    build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce --reps 1 > $OUT/ncu_sparse.txt 2>&1
timeout 200 ncu --set full -k regex:"nvjet|gemm_bf16|bf16.*gemm" --launch-skip 40 --launch-count 2 \
    build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce_nofilter --reps 1 > $OUT/ncu_cublas.txt 2>&1
grep -E "cce_sparse|nvjet|gemm|Duration|Throughput|Achieved Occupancy|L2 Hit|Registers Per|Block Size|Grid Size|Theoretical Occ|Executed Ipc|One or More|Stall|Elapsed Cycles" $OUT/ncu_sparse.txt $OUT/ncu_cublas.txt | head -120

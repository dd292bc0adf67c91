#!/usr/bin/env bash
# Re-run of the cases that moved in the first A/B: carried binaries (built on cpu2), base and new in turn, 4 rounds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
mkdir -p /tmp/abx
for r in 1 2 3 4; do for who in base new; do
  echo "== $who round $r"
  ./bin/kfa_bench_sdpa_$who --out /tmp/abx --dtypes bf16,fp16 --d 128,256 --n 4096 --causal 0,1 --reps 30 "$@" | grep -v '^#' | sed "s/^/$who $r /"
done; done

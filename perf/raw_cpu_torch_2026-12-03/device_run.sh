#!/usr/bin/env bash
# kfa's CPU benchmarks (Debian 12 build: Kokkos 3.4.01 Serial, one thread, -march=x86-64-v4)
# against PyTorch CPU SDPA (one thread), same shapes, interleaved twice, each pinned to one core.
set -u
export OPENBLAS_NUM_THREADS=1
H=$(cd "$(dirname "$0")" && pwd); L=$H/lib; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { taskset -c 3 "$L/ld-linux-x86-64.so.2" --library-path "$L" "$@"; }
{
  echo "# $(date -u +%FT%TZ)"; lscpu; nproc; ldd --version | head -1; uptime
  python3 -c "import torch; print('torch', torch.__version__)" || echo "no torch"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | grep -E "Model name|torch|^CPU\(s\)|Flags" | cut -c1-300
for round in ${ROUNDS:-1 2}; do
  run "$H/kfa_bench_forward" --n 1024,4096 --d 64,128 --heads 4 --reps 5 --reference-max-n 0 --gemm-n 512 > "$OUT/r${round}_kfa_forward.txt" 2>&1
  OMP_NUM_THREADS=1 taskset -c 3 python3 "$H/torch_cpu_sdpa.py" --n 1024,4096 --d 64,128 --heads 4 --reps 5 --threads 1 \
      --backends flash > "$OUT/r${round}_torch.txt" 2>&1
  run "$H/kfa_bench_backward" --n 1024,4096 --d 64,128 --heads 4 --reps 5 --reference-max-n 0 --gemm-n 512 > "$OUT/r${round}_kfa_backward.txt" 2>&1
  tail -n +1 "$OUT/r${round}"_*.txt | cut -c1-160
done
uptime

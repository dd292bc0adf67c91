#!/usr/bin/env bash
# One thread, N=4096, d=128, float: kfa forward and forward+backward per build and host ISA, each next to
# single-thread OpenBLAS sgemm 2048^3 measured in the same process (the benchmarks' GEMM ceiling).
#
#   perf/cpu_isa_matrix.sh LABEL:BUILD_DIR:ISA [...]      (ISA: a KFA_HOST_ISA value, or "-" for uncapped)
#   e.g. perf/cpu_isa_matrix.sh native:build:- v3-avx2:build-v3:avx2 x86-64:build-x86-64:- sse2:build-x86-64:sse2
#
# Build dirs: cmake -S . -B build-v3 -DKFA_HOST_ARCH=x86-64-v3 (and x86-64, znver3, ...). Add :fwd to a spec
# to skip the backward (slow builds). Prints a markdown table; the raw benchmark output goes to stderr.
set -euo pipefail
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
N=${N:-4096}
D=${D:-128}
echo "| build | KFA_HOST_ISA | host SIMD | BLAS | sgemm GFLOP/s | fwd GFLOP/s | fwd/sgemm | fwd causal/sgemm | bwd GFLOP/s | bwd/sgemm |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for spec in "$@"; do
  IFS=: read -r label dir isa only <<<"$spec"
  envs=()
  [ "$isa" != "-" ] && envs=(KFA_HOST_ISA="$isa")
  f=$(env "${envs[@]}" "$dir/perf/kfa_bench_forward" --n "$N" --d "$D" --no-reference --reps 3)
  echo "$f" >&2
  simd=$(echo "$f" | sed -n 's/^# host SIMD: //p')
  blas=$(echo "$f" | sed -n 's/.*(BLAS: \(.*\))$/\1/p' | sed 's|.*/\([^/]*\)/libblas.so.3|\1|')
  gemm=$(echo "$f" | sed -n 's/^# GEMM ceiling: .*: \([0-9.]*\) GFLOP.*/\1/p')
  fwd=$(echo "$f" | awk -v n="$N" '$1==n && $3=="no" {print $6}')
  fwdr=$(echo "$f" | awk -v n="$N" '$1==n && $3=="no" {print $7}')
  fwdc=$(echo "$f" | awk -v n="$N" '$1==n && $3=="yes" {print $7}')
  bwd="–"
  bwdr="–"
  if [ "${only:-}" != fwd ]; then
    b=$(env "${envs[@]}" "$dir/perf/kfa_bench_backward" --n "$N" --d "$D" --reference-max-n 0 --reps 1)
    echo "$b" >&2
    gemm_b=$(echo "$b" | sed -n 's/^# GEMM ceiling: .*: \([0-9.]*\) GFLOP.*/\1/p')
    bwd=$(echo "$b" | awk -v n="$N" '$1==n && $3=="no" {print $7}')
    bwdr=$(echo "$b" | awk -v n="$N" '$1==n && $3=="no" {print $8}')
    bwdr="$bwdr (sgemm $gemm_b)"
  fi
  echo "| $label | $isa | ${simd:-(not printed)} | ${blas:-?} | $gemm | $fwd | $fwdr | $fwdc | $bwd | $bwdr |"
done

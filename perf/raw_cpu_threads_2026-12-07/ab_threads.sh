#!/usr/bin/env bash
# Interleaved A/B of two Kokkos OpenMP builds on 2 threads: ab_threads.sh BENCH BASE_BUILD NEW_BUILD ROUNDS
# (BENCH = forward or backward; HEADS, NS, DS, REPS override; the order alternates per round).
bench=$1; base=$2; new=$3; rounds=$4
export OMP_NUM_THREADS=2 OMP_PROC_BIND=spread OMP_PLACES=threads
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base; [ "$v" = new ] && b=$new
    for h in ${HEADS:-1 2 3}; do
      echo "-- $v round $r heads $h"
      "$b/perf/kfa_bench_$bench" --n "${NS:-4096,8192}" --d "${DS:-64,128}" --heads "$h" --reps "${REPS:-3}" \
        --reference-max-n 0 --gemm-n 256 2>&1 | grep -E "^ +[0-9]|FMA peak"
    done
  done
done

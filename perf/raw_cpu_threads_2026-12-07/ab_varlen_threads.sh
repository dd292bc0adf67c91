#!/usr/bin/env bash
# Interleaved A/B of kfa_bench_varlen (fp32, 65,536 tokens, 2 heads, causal) on 2 OpenMP threads:
# ab_varlen_threads.sh BASE_BUILD NEW_BUILD ROUNDS
base=$1; new=$2; rounds=$3
export OMP_NUM_THREADS=2 OMP_PROC_BIND=spread OMP_PLACES=threads
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base; [ "$v" = new ] && b=$new
    for d in 128 64; do
      "$b/perf/kfa_bench_varlen" --dtype fp32 --d $d --hidden $((2 * d)) --tokens 65536 --reps 2 --causal 1 2>&1 |
        grep -E "^(varlen|fixed|#)" | sed "s/^/$v $r /"
    done
  done
done

#!/usr/bin/env bash
# Interleaved A/B of kfa_bench_varlen (fp32, 65,536 tokens, 2 heads): ab_varlen.sh BASE_BUILD NEW_BUILD ROUNDS CPU
base=$1; new=$2; rounds=$3; cpu=$4
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base; [ "$v" = new ] && b=$new
    for d in 128 64; do
      taskset -c "$cpu" "$b/perf/kfa_bench_varlen" --dtype fp32 --d $d --hidden $((2 * d)) --tokens 65536 --reps 2 \
        --causal "${CAUSAL:-1}" 2>&1 | grep -E "^(varlen|fixed)" | sed "s/^/$v $r /"
    done
  done
done

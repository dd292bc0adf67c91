#!/usr/bin/env bash
# Interleaved A/B of kfa_bench_forward or kfa_bench_backward: ab_bench.sh BENCH BASE_BUILD NEW_BUILD ROUNDS CPU
# (BENCH = forward or backward; NS, DS, REPS override the sizes and repetitions; the order alternates per round).
bench=$1; base=$2; new=$3; rounds=$4; cpu=$5
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base; [ "$v" = new ] && b=$new
    echo "-- $v round $r"
    taskset -c "$cpu" "$b/perf/kfa_bench_$bench" --n "${NS:-2048,4096,8192}" --d "${DS:-64,128}" --heads 2 \
      --reps "${REPS:-3}" --reference-max-n 0 --gemm-n 256 2>&1 | grep -E "^ +[0-9]|FMA peak"
  done
done

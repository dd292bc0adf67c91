#!/usr/bin/env bash
# interleaved A/B of kfa_bench_backward: base = $1 build, new = $2 build, $3 rounds, cpu $4, extra env in ISA
base=$1; new=$2; rounds=$3; cpu=$4
for r in $(seq 1 $rounds); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for v in $order; do
    b=$base; [ $v = new ] && b=$new
    echo "-- $v round $r"
    taskset -c $cpu $b/perf/kfa_bench_backward --n ${NS:-2048,4096,8192} --d ${DS:-64,128} --heads 2 --reps ${REPS:-3} --reference-max-n 0 --gemm-n 256 2>&1 | grep -E "^ +[0-9]|FMA peak"
  done
done

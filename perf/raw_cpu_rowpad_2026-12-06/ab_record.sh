#!/bin/bash
# interleaved A/B of base (main 496f111) and new (cpu38) benchmark binaries, one core; raw lines kept
out=/tmp/peer/ab_record.txt; : > $out
run() { # label bin args...
  local label=$1 bin=$2; shift 2
  taskset -c 1 $bin --gemm-n 64 "$@" 2>&1 | grep -E '^ +[0-9]+ |FMA peak' | sed "s|^|$label |" >> $out
}
for r in 1 2 3; do
  run "fwd-native base" /tmp/bmain/perf/kfa_bench_forward --no-reference --n 2048,4096,8192 --d 64,128 --heads 2 --reps 3
  run "fwd-native new" /tmp/bw/perf/kfa_bench_forward --no-reference --n 2048,4096,8192 --d 64,128 --heads 2 --reps 3
  run "fwd-native-h16 base" /tmp/bmain/perf/kfa_bench_forward --no-reference --n 2048 --d 64,128 --heads 16 --reps 3
  run "fwd-native-h16 new" /tmp/bw/perf/kfa_bench_forward --no-reference --n 2048 --d 64,128 --heads 16 --reps 3
  run "bwd-native base" /tmp/bmain/perf/kfa_bench_backward --reference-max-n 0 --n 2048,4096 --d 64,128 --heads 2 --reps 2
  run "bwd-native new" /tmp/bw/perf/kfa_bench_backward --reference-max-n 0 --n 2048,4096 --d 64,128 --heads 2 --reps 2
  KFA_HOST_ISA=avx2 run "fwd-avx2 base" /tmp/bmain3/perf/kfa_bench_forward --no-reference --n 2048,4096 --d 64,128 --heads 2 --reps 3
  KFA_HOST_ISA=avx2 run "fwd-avx2 new" /tmp/bw3/perf/kfa_bench_forward --no-reference --n 2048,4096 --d 64,128 --heads 2 --reps 3
  KFA_HOST_ISA=avx2 run "bwd-avx2 base" /tmp/bmain3/perf/kfa_bench_backward --reference-max-n 0 --n 2048,4096 --d 64,128 --heads 2 --reps 2
  KFA_HOST_ISA=avx2 run "bwd-avx2 new" /tmp/bw3/perf/kfa_bench_backward --reference-max-n 0 --n 2048,4096 --d 64,128 --heads 2 --reps 2
done
echo done >> /tmp/peer/ab_record.done

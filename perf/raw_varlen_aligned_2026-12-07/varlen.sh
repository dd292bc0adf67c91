#!/usr/bin/env bash
# Document-aligned blocks (issue 36) on one GPU: phase "test" runs the suites and compute-sanitizer, phase
# "bench" the kfa-vs-kfa A/B (base = main before the change, new = the change) and varlen_compare.py.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -x /tmp/x/new/kfa_bench_varlen ] || tar -xJf .device/varlen.tar.xz -C /tmp/x
[ -x /tmp/x/base/kfa_bench_varlen ] || tar -xJf .device/base.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
N=/tmp/x/new B=/tmp/x/base
case "${1:-test}" in
test)
  for t in paths varlen; do
    t0=$(date +%s); timeout 240 $N/kfa_test_$t > "$OUT/test_$t.log" 2>&1
    echo "kfa_test_$t rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/test_$t.log"
  done
  t0=$(date +%s)
  KFA_TEST_SMALL=1 timeout 200 compute-sanitizer --tool memcheck $N/kfa_test_varlen \
    --gtest_filter='*EveryMask*:*QueryAndKeyLengthsDiffer*:*ThousandsOfShort*:*EqualsFixedLength*' \
    > "$OUT/memcheck.txt" 2>&1
  echo "memcheck rc=$? $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/memcheck.txt"
  ;;
suites)
  for t in forward backward; do
    t0=$(date +%s); timeout 280 $N/kfa_test_$t > "$OUT/test_$t.log" 2>&1
    echo "kfa_test_$t rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/test_$t.log"
  done
  ;;
bench)
  for d in 128 64; do
    for r in 1 2; do
      order="base new"; [ $r = 2 ] && order="new base"
      for w in $order; do
        echo "## $w $r" >> "$OUT/ab_mix_d$d.txt"
        timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 \
          >> "$OUT/ab_mix_d$d.txt" 2>&1
      done
    done
  done
  for r in 1 2; do
    order="base new"; [ $r = 2 ] && order="new base"
    for w in $order; do
      echo "## $w $r" >> "$OUT/ab_eq_d128.txt"
      timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d 128 --hidden 2048 --causal 0,1 --reps 10 \
        --lengths 4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096 \
        >> "$OUT/ab_eq_d128.txt" 2>&1
    done
  done
  grep -v "^lengths" "$OUT"/ab_*.txt | grep -v "^#" | head -60
  for d in 128 64; do
    timeout 120 python3 perf/varlen_compare.py --kfa-bench $N/kfa_bench_varlen --d $d --reps 10 \
      > "$OUT/compare_mix_d$d.txt" 2>&1
    tail -4 "$OUT/compare_mix_d$d.txt"
  done
  ;;
esac

#!/usr/bin/env bash
# base (main), new (aligned blocks), new2 (aligned blocks + sections by document) in turn; the mix at d 128/64 and
# 16 x 4096 at d 128; then the mix in other orders with new2.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/x "$OUT"
for t in new base new2; do tar -xJf .device/$t.tar.xz -C /tmp/x; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
. .device/lens.sh
EQ=4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096,4096
run() {  # file, binary, args
  local f=$1 w=$2; shift 2
  echo "## $w" >> "$OUT/$f"
  timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --hidden 2048 --causal 0,1 --reps 10 "$@" >> "$OUT/$f" 2>&1
}
for r in 1 2; do
  order="base new new2"; [ $r = 2 ] && order="new2 new base"
  for w in $order; do
    run ab3_mix_d128.txt $w --d 128
    run ab3_mix_d64.txt $w --d 64
    run ab3_eq_d128.txt $w --d 128 --lengths $EQ
  done
done
for k in desc asc round; do v=L_$k; run order_d128.txt new2 --d 128 --lengths ${!v}; done
ls -la "$OUT"
for t in paths varlen; do
  t0=$(date +%s); timeout 120 /tmp/x/new2/kfa_test_$t > "$OUT/test2_$t.log" 2>&1
  echo "kfa_test_$t rc=$? $(( $(date +%s) - t0 )) s"; grep -E "PASSED|FAILED" "$OUT/test2_$t.log"
done

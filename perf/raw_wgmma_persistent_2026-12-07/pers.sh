#!/usr/bin/env bash
# The wgmma zero-rows fix and the persistent wgmma forward on one GPU. Phases:
#   iso      the new build's isolation test (every family), then the rest of its kfa_test_varlen
#   test     the new build's kfa_test_forward and kfa_test_paths
#   wz       the zero-rows-only build's isolation test (if the new build fails it)
#   san      compute-sanitizer memcheck and racecheck: the isolation test's bf16 case and the bf16 tensor-core
#            path cases (small)
#   bench    base (main's forward with the zero-rows fix) against new (persistent): kfa_bench_sdpa forward-only,
#            bf16, d 64/128, N 4096/16384, causal or not, and the varlen mix at d 128/64; 2 rounds alternating
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -x /tmp/x/base/kfa_bench_sdpa ] || tar -xJf .device/wzbase.tar.xz -C /tmp/x
[ -x /tmp/x/new/kfa_test_forward ] || tar -xJf .device/new.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/gpu.txt"
N=/tmp/x/new
run_iso() {  # $1 = binary dir, $2 = log prefix
  local t0=$(date +%s)
  timeout 200 $1/kfa_test_varlen --gtest_filter='*EveryFamily*' > "$OUT/$2_every_family.log" 2>&1
  echo "$2 every_family rc=$? $(( $(date +%s) - t0 )) s"
  grep -E 'Failure|Which is|opts.path|FAILED|PASSED' "$OUT/$2_every_family.log" | head -30
}
for phase in "$@"; do
case "$phase" in
iso)
  run_iso $N new
  t0=$(date +%s); timeout 240 $N/kfa_test_varlen --gtest_filter='-*EveryFamily*' > "$OUT/new_varlen_rest.log" 2>&1
  echo "varlen rest rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAILED|Failure" "$OUT/new_varlen_rest.log" | head -5
  tail -2 "$OUT/new_varlen_rest.log"
  ;;
wz) run_iso /tmp/x/wz wz ;;
test)
  for t in forward paths; do
    t0=$(date +%s); timeout 240 $N/kfa_test_$t > "$OUT/new_test_$t.log" 2>&1
    echo "kfa_test_$t rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAILED|Failure" "$OUT/new_test_$t.log" | head -8
    tail -2 "$OUT/new_test_$t.log"
  done
  ;;
san)
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    timeout 150 compute-sanitizer --tool $tool $N/kfa_test_varlen \
      --gtest_filter='Varlen/bfloat16.AnotherSequencesNonFiniteRowsStayOutOfEveryFamily' > "$OUT/new_${tool}_iso.txt" 2>&1
    echo "$tool iso rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/new_${tool}_iso.txt"
    t0=$(date +%s)
    KFA_TEST_SMALL=1 timeout 150 compute-sanitizer --tool $tool $N/kfa_test_paths \
      --gtest_filter='Paths/bfloat16.TensorCore*' > "$OUT/new_${tool}_paths.txt" 2>&1
    echo "$tool paths rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/new_${tool}_paths.txt"
  done
  ;;
bench)
  for r in 1 2; do
    order="base new"; [ $r = 2 ] && order="new base"
    for w in $order; do
      echo "## $w $r" >> "$OUT/ab_sdpa.txt"
      timeout 90 /tmp/x/$w/kfa_bench_sdpa --out /tmp/sd_$w --dtypes bf16 --d 64,128 --n 4096,16384 --causal 0,1 \
        --reps 10 --no-backward >> "$OUT/ab_sdpa.txt" 2>&1
      for d in 128 64; do
        echo "## $w $r d$d" >> "$OUT/ab_mix.txt"
        timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 \
          >> "$OUT/ab_mix.txt" 2>&1
      done
    done
  done
  grep -v "^lengths" "$OUT/ab_sdpa.txt" | head -50; grep -v "^lengths" "$OUT/ab_mix.txt" | head -50
  ;;
esac
done

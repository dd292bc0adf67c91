#!/usr/bin/env bash
# GPU checks of main's wgmma zero-rows fix and of builds under test (NEW = pers: the persistent wgmma forward;
# skip: the forward's products cut to the keys a warpgroup sees; search: that and the k-ary document search).
# Usage: [NEW=name] gpu8.sh PHASE...   (NEW's binaries from .device/NEW.tar.xz, main's from .device/main8.tar.xz)
#   main     main's kfa_test_varlen, _paths, _backward, _forward, _nonfinite (float64-checked, every head dim)
#   msan-mem, msan-race   compute-sanitizer memcheck / racecheck on main's wgmma kernels (bf16 isolation test,
#            varlen head dims 96/256, paths tensor-core cases; KFA_TEST_SMALL)
#   psmoke   NEW: one forward per kernel shape (d 64 = three warpgroups, d 128 = two), 25 s each
#   ptest    NEW: kfa_test_forward, _varlen, _paths, _nonfinite (and _backward where it has one)
#   psan-mem, psan-race   NEW: as msan-*
#   bench    main against NEW: kfa_bench_varlen mix d 128/64 and kfa_bench_sdpa forward, 2 rounds alternated
#   lens     main and NEW, alternated: packed vs fixed at equal lengths (2688, 1024, 256, 128); the mix against
#            PyTorch's varlen path (NEW's, else main's)
#   quick    main against NEW, forward only: the mix and equal lengths, 2 rounds; memcheck on two varlen tests
#   peer     NEW against PyTorch SDPA (flash, cuDNN), bf16, d 64/128, N 4096/16384
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -f .device/main8.tar.xz ] && [ ! -x /tmp/x/main/kfa_test_varlen ] && tar -xJf .device/main8.tar.xz -C /tmp/x
NEW=${NEW:-pers}  # the build under test: pers (the persistent forward) or skip (the per-warpgroup key bound)
[ -f .device/$NEW.tar.xz ] && [ ! -x /tmp/x/$NEW/kfa_test_varlen ] && tar -xJf .device/$NEW.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/gpu.txt"
suite() {  # $1 dir, $2 prefix, $3 timeout, tests...
  local dir=$1 pre=$2 lim=$3; shift 3
  for t in "$@"; do
    local t0=$(date +%s)
    timeout $lim $dir/kfa_test_$t > "$OUT/${pre}_$t.log" 2>&1
    echo "$pre kfa_test_$t rc=$? $(( $(date +%s) - t0 )) s"; grep -E "FAILED|Failure" "$OUT/${pre}_$t.log" | head -6
    tail -1 "$OUT/${pre}_$t.log"
  done
}
san() {  # $1 dir, $2 prefix, $3 tool
  for tool in $3; do
    for spec in "varlen:Varlen/bfloat16.AnotherSequencesNonFiniteRowsStayOutOfEveryFamily" \
                "varlen:Varlen/bfloat16.HeadDims96And256" "paths:Paths/bfloat16.TensorCore*"; do
      [ $tool = racecheck ] && [ "${spec#*.}" = AnotherSequencesNonFiniteRowsStayOutOfEveryFamily ] && continue  # > 90 s
      local bin=${spec%%:*} filt=${spec#*:} t0=$(date +%s) tag=$(echo "${spec#*.}" | tr -cd 'A-Za-z0-9' | cut -c1-24)
      KFA_TEST_SMALL=1 timeout 90 compute-sanitizer --tool $tool $1/kfa_test_$bin --gtest_filter="$filt" \
        > "$OUT/$2_${tool}_$tag.txt" 2>&1
      echo "$2 $tool $bin $filt rc=$? $(( $(date +%s) - t0 )) s"; grep -E "ERROR SUMMARY|Hazard|FAILED|PASSED" \
        "$OUT/$2_${tool}_$tag.txt" | sort | uniq -c | head -5
    done
  done
}
for phase in "$@"; do
case "$phase" in
main) suite /tmp/x/main main 100 varlen paths backward forward nonfinite ;;
msan-mem) san /tmp/x/main main memcheck ;;
msan-race) san /tmp/x/main main racecheck ;;
psmoke)
  for spec in 'varlen:Varlen/bfloat16.EveryMask' 'forward:Forward/bfloat16.HeadDims'; do
    t0=$(date +%s); timeout 25 /tmp/x/$NEW/kfa_test_${spec%%:*} --gtest_filter="${spec#*:}" > "$OUT/${NEW}_smoke.log" 2>&1
    echo "smoke $spec rc=$? $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/${NEW}_smoke.log"
  done ;;
ptest) suite /tmp/x/$NEW $NEW 100 forward varlen paths nonfinite $([ -x /tmp/x/$NEW/kfa_test_backward ] && echo backward) ;;
psan-mem) san /tmp/x/$NEW $NEW memcheck ;;
psan-race) san /tmp/x/$NEW $NEW racecheck ;;
bench)
  mkdir -p /tmp/sd_main /tmp/sd_$NEW
  for r in 1 2; do
    order="main $NEW"; [ $r = 2 ] && order="$NEW main"
    for w in $order; do
      for d in 128 64; do
        echo "## $w $r d$d" >> "$OUT/ab_mix.txt"
        timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 \
          >> "$OUT/ab_mix.txt" 2>&1
      done
      echo "## $w $r" >> "$OUT/ab_sdpa.txt"
      timeout 90 /tmp/x/$w/kfa_bench_sdpa --out /tmp/sd_$w --dtypes bf16 --d 64,128 --n 4096,16384 --causal 0,1 \
        --reps 10 --no-backward >> "$OUT/ab_sdpa.txt" 2>&1
    done
  done
  grep -v "^lengths" "$OUT/ab_mix.txt" | head -40; grep -v "^lengths" "$OUT/ab_sdpa.txt" | head -40 ;;
lens)  # main and NEW (if any): packed vs fixed at equal lengths; NEW's mix against PyTorch's varlen path
  builds=main; [ -x /tmp/x/$NEW/kfa_bench_varlen ] && builds="main $NEW $NEW main"
  for w in $builds; do
    for d in 128 64; do
      for spec in 24x2688 64x1024 256x256 512x128; do
        n=${spec%x*} L=${spec#*x}; list=$(python3 -c "print(','.join(['$L']*$n))")
        echo "## $w d$d $spec" >> "$OUT/lens.txt"
        timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 \
          --lengths $list 2>&1 | grep -v "^lengths" >> "$OUT/lens.txt"
      done
    done
  done
  w=${builds##* }; [ -x /tmp/x/$NEW/kfa_bench_varlen ] && w=$NEW
  for d in 128 64; do
    t0=$(date +%s)
    timeout 120 python3 perf/varlen_compare.py --kfa-bench /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d \
      --hidden 2048 --causal 0,1 --reps 10 > "$OUT/varlen_compare_${w}_d$d.txt" 2>&1
    echo "varlen_compare $w d$d rc=$? $(( $(date +%s) - t0 )) s"
  done
  grep -E "^##|^varlen|^fixed" "$OUT/lens.txt" | awk '/^##/{h=$2" "$3" "$4; next} {print h, $1, $4, $9, $11}'
  for f in "$OUT"/varlen_compare_*.txt; do tail -n 5 "$f"; done ;;
peer)  # the build under test against PyTorch SDPA (flash, cuDNN) in the same run, bf16
  t0=$(date +%s)
  timeout 300 python3 perf/sdpa_compare.py --kfa-bench /tmp/x/$NEW/kfa_bench_sdpa --out "$OUT/peer" --rows /tmp/rows \
    --dtypes bf16 --d 64,128 --n 4096,16384 --causal 0,1 --reps 10 > "$OUT/peer.log" 2> "$OUT/peer.err"
  echo "peer rc=$? $(( $(date +%s) - t0 )) s"; grep -v "^#row" "$OUT/peer.log" | tail -14 ;;
quick)  # main against NEW, alternated, forward only: the mix and equal lengths; then memcheck of the isolation test
  for w in main $NEW $NEW main; do
    for d in 128 64; do
      for spec in mix 24x2688 256x256 512x128; do
        if [ $spec = mix ]; then lens=""; else
          n=${spec%x*} L=${spec#*x}; lens="--lengths $(python3 -c "print(','.join(['$L']*$n))")"; fi
        echo "## $w d$d $spec" >> "$OUT/quick.txt"
        timeout 40 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 \
          --no-backward $lens 2>&1 | grep -v "^lengths" >> "$OUT/quick.txt"
      done
    done
  done
  grep -E "^##|^varlen|^fixed" "$OUT/quick.txt" | awk '/^##/{h=$2" "$3" "$4; next} {print h, $1, $4, $9}'
  KFA_TEST_SMALL=1 timeout 60 compute-sanitizer --tool memcheck /tmp/x/$NEW/kfa_test_varlen \
    --gtest_filter='Varlen/bfloat16.AnotherSequencesNonFiniteRowsStayOutOfEveryFamily:Varlen/bfloat16.ThousandsOf*' \
    > "$OUT/${NEW}_memcheck_quick.txt" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/${NEW}_memcheck_quick.txt" ;;
esac
done

#!/usr/bin/env bash
# GPU checks of main's wgmma zero-rows fix and of the persistent wgmma forward. Usage: gpu8.sh PHASE...
#   main     main's kfa_test_varlen, _paths, _backward, _forward, _nonfinite (float64-checked, every head dim)
#   msan-mem, msan-race   compute-sanitizer memcheck / racecheck on main's wgmma kernels (bf16 isolation test,
#            varlen head dims 96/256, paths tensor-core cases; KFA_TEST_SMALL)
#   psmoke   persistent build: one forward per kernel shape (d 64 = three warpgroups, d 128 = two), 20 s each
#   ptest    persistent build: kfa_test_forward, _varlen, _paths
#   psan-mem, psan-race   persistent build: as msan-*
#   bench    main against persistent: kfa_bench_varlen mix d 128/64 and kfa_bench_sdpa forward, 2 rounds alternated
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -f .device/main8.tar.xz ] && [ ! -x /tmp/x/main/kfa_test_varlen ] && tar -xJf .device/main8.tar.xz -C /tmp/x
[ -f .device/pers8.tar.xz ] && [ ! -x /tmp/x/pers/kfa_test_varlen ] && tar -xJf .device/pers8.tar.xz -C /tmp/x
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
    t0=$(date +%s); timeout 25 /tmp/x/pers/kfa_test_${spec%%:*} --gtest_filter="${spec#*:}" > "$OUT/pers_smoke.log" 2>&1
    echo "smoke $spec rc=$? $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/pers_smoke.log"
  done ;;
ptest) suite /tmp/x/pers pers 120 forward varlen paths ;;
psan-mem) san /tmp/x/pers pers memcheck ;;
psan-race) san /tmp/x/pers pers racecheck ;;
bench)
  mkdir -p /tmp/sd_main /tmp/sd_pers
  for r in 1 2; do
    order="main pers"; [ $r = 2 ] && order="pers main"
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
esac
done

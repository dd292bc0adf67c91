#!/usr/bin/env bash
# Builds compared: old = main a03df6c (binary document searches), search = main 8bd7d08 (the k-ary search,
# last_where), doc = search + each CUDA block's document handed to its kernel (QueryBlock/KeyBlock::documents(),
# no second search), table = doc + the launch's table of each document's first block in its arguments (no empty
# blocks). Binaries from .device/dt.tar.xz (doc/ and table/) and .device/os.tar.xz (old/ and search/), xz with a
# 1 GiB dictionary (the test binaries share the kernels).
# Usage: ab.sh PHASE...
#   test      doc and table: kfa_test_varlen, _paths, _forward, _backward, _nonfinite (float64-checked, every head dim)
#   memcheck  table: compute-sanitizer memcheck, the documents' isolation test and thousands of short documents
#   fwd       the builds alternated (old search doc table table doc search old), forward only, bf16, 65,536 tokens:
#             the log-normal mix and equal lengths L × n (d 128: 2688, 1024, 256, 128 and 129; d 64: 256, 128),
#             each packed against the fixed-length call of the same lengths (kfa_bench_varlen --lengths)
#   fb        the same with forward+backward, doc table table doc, d 128: mix, 256, 128, 129; d 64: mix
#   peer      table against PyTorch's varlen path on the log-normal mix (perf/varlen_compare.py), d 128 and 64
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -f .device/dt.tar.xz ] && [ ! -d /tmp/x/table ] && tar -xJf .device/dt.tar.xz -C /tmp/x
[ -f .device/os.tar.xz ] && [ ! -d /tmp/x/old ] && tar -xJf .device/os.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/gpu.txt"
bench() {  # $1 file, $2 extra flags, $3 builds, then d:spec...
  local file=$1 extra=$2 builds=$3; shift 3
  for w in $builds; do
    for ds in "$@"; do
      local d=${ds%%:*} spec=${ds#*:} lens=""
      if [ "$spec" != mix ]; then
        local n=${spec%x*} L=${spec#*x}
        lens="--lengths $(python3 -c "print(','.join(['$L']*$n))")"
      fi
      echo "## $w d$d $spec" >> "$OUT/$file"
      timeout 60 /tmp/x/$w/kfa_bench_varlen --dtype bf16 --d $d --hidden 2048 --causal 0,1 --reps 10 $extra $lens 2>&1 |
        grep -v "^lengths" >> "$OUT/$file"
    done
  done
}
for phase in "$@"; do
  t0=$(date +%s)
  case "$phase" in
  test)
    for w in table doc; do
      for t in varlen paths forward backward nonfinite; do
        [ -x /tmp/x/$w/kfa_test_$t ] || continue
        t1=$(date +%s)
        timeout 100 /tmp/x/$w/kfa_test_$t > "$OUT/${w}_$t.log" 2>&1
        echo "$w kfa_test_$t rc=$? $(( $(date +%s) - t1 )) s"; grep -E "FAILED|Failure" "$OUT/${w}_$t.log" | head -6
        tail -1 "$OUT/${w}_$t.log"
      done
    done ;;
  memcheck)
    KFA_TEST_SMALL=1 timeout 120 compute-sanitizer --tool memcheck /tmp/x/table/kfa_test_varlen \
      --gtest_filter='Varlen/bfloat16.AnotherSequencesNonFiniteRowsStayOutOfEveryFamily:Varlen/*.ThousandsOf*' \
      > "$OUT/table_memcheck.txt" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/table_memcheck.txt" | sort | uniq -c ;;
  fwd)
    bench fwd.txt --no-backward "old search doc table table doc search old" 128:mix 128:24x2688 128:64x1024 128:256x256 \
      128:512x128 128:508x129 64:mix 64:256x256 64:512x128 ;;
  fb)
    bench fb.txt "" "doc table table doc" 128:mix 128:256x256 128:512x128 128:508x129 64:mix ;;
  peer)
    for d in 128 64; do
      timeout 150 python3 perf/varlen_compare.py --kfa-bench /tmp/x/table/kfa_bench_varlen --dtype bf16 --d $d \
        --hidden 2048 --causal 0,1 --reps 10 > "$OUT/varlen_compare_table_d$d.txt" 2>&1
      echo "varlen_compare d$d rc=$?"; tail -n 5 "$OUT/varlen_compare_table_d$d.txt"
    done ;;
  esac
  echo "phase $phase $(( $(date +%s) - t0 )) s"
done

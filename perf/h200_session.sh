#!/usr/bin/env bash
# What one lent-GPU call runs (see perf/RESULTS.md, "H200"): binaries built on the workstation with the
# Kokkos CUDA build (HOPPER90) are carried in .device/ with libcudart; this script runs the test suite,
# compute-sanitizer on a small case and the SDPA comparison, logging everything under $OUT.
#
#   bash perf/h200_session.sh tests|sanitize|compare|variants|all [extra args for sdpa_compare.py / the bench]
set -u
what=${1:-all}
shift || true
D=$(pwd)/.device
OUT=${OUT:-/tmp/kfa-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$D:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
status=0

run_tests() {
  for t in kfa_test_paths kfa_test_forward kfa_test_backward kfa_test_errors kfa_test_memory kfa_test_online_softmax; do
    [ -x "$D/$t" ] || continue
    echo "== $t"
    timeout 600 "$D/$t" --gtest_brief=1 > "$OUT/$t.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/$t.log"
    [ $rc -eq 0 ] || { echo "!! $t rc=$rc"; grep -B2 -A8 "Failure\|error" "$OUT/$t.log" | head -60; status=1; }
  done
  # The examples' CTest commands (examples/CMakeLists.txt), where carried.
  for ex in "kfa_example_forward --seq 1000 --heads 2 --head-dim 64 --check 8 --repeat 1" \
            "kfa_example_forward --seq 777 --heads 4 --kv-heads 2 --head-dim 128 --causal --check 8 --repeat 1" \
            "kfa_example_backward"; do
    set -- $ex
    [ -x "$D/$1" ] || continue
    echo "== $ex"
    timeout 300 "$D/$1" "${@:2}" > "$OUT/$1.log" 2>&1
    rc=$?
    tail -n 2 "$OUT/$1.log"
    [ $rc -eq 0 ] || { echo "!! $1 rc=$rc"; status=1; }
  done
  if [ -x "$D/kfa_example_ring" ]; then
    echo "== mpirun -np 2 kfa_example_ring --seq 2000"
    timeout 300 mpirun --oversubscribe --allow-run-as-root -np 2 "$D/kfa_example_ring" --seq 2000 > "$OUT/ex_ring.log" 2>&1
    rc=$?
    tail -n 2 "$OUT/ex_ring.log"
    [ $rc -eq 0 ] || { echo "!! example ring rc=$rc"; status=1; }
  fi
  if [ -x "$D/kfa_test_ring" ]; then
    for np in 1 2 3; do
      echo "== kfa_test_ring np=$np"
      timeout 600 mpirun --oversubscribe --allow-run-as-root -np $np "$D/kfa_test_ring" --gtest_brief=1 \
        > "$OUT/kfa_test_ring_np$np.log" 2>&1
      rc=$?
      tail -n 2 "$OUT/kfa_test_ring_np$np.log"
      [ $rc -eq 0 ] || { echo "!! ring np=$np rc=$rc"; status=1; }
    done
  fi
}

run_sanitize() {
  # A small case of each tensor-core kernel (forward, dK/dV, dQ), the fp32 CUDA forward and the portable path.
  local f='Paths/*.TensorCoreAgreesWithPortableAndReference:Paths.FloatAutomaticAgreesWithPortableAndReference'
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    KFA_TEST_SMALL=1 timeout 600 compute-sanitizer --tool $tool --error-exitcode 9 "$D/kfa_test_paths" \
      --gtest_filter="$f" > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    tail -n 4 "$OUT/sanitizer_$tool.log"
    [ $rc -eq 0 ] || { echo "!! sanitizer $tool rc=$rc"; grep -m20 "=========" "$OUT/sanitizer_$tool.log"; status=1; }
  done
}

run_compare() {
  echo "== sdpa_compare $*"
  timeout 900 python3 perf/sdpa_compare.py --kfa-bench "$D/kfa_bench_sdpa" --out "$OUT/sdpa" --rows /tmp/kfa-rows "$@" \
    > "$OUT/sdpa_compare.log" 2> "$OUT/sdpa_compare.err"
  rc=$?
  grep -v "^#row" "$OUT/sdpa_compare.log" | tail -n 60
  [ $rc -eq 0 ] || { echo "!! sdpa_compare rc=$rc"; tail -n 30 "$OUT/sdpa_compare.err"; status=1; }
}

run_variants() {
  # Tuning experiments: bench binaries built with other KFA_TC_* knobs, same cases, forward only.
  mkdir -p /tmp/kfa-rows
  for b in "$D"/kfa_bench_sdpa "$D"/kfa_bench_sdpa_*; do
    [ -x "$b" ] || continue
    echo "== $(basename "$b") $*"
    timeout 300 "$b" --out /tmp/kfa-rows --no-backward "$@" 2>&1 | grep -v "^#"
  done
}

case $what in
  tests) run_tests ;;
  sanitize) run_sanitize ;;
  compare) run_compare "$@" ;;
  variants) run_variants "$@" ;;
  all) run_tests; run_sanitize; run_compare "$@" ;;
  *) echo "usage: $0 tests|sanitize|compare|variants|all"; exit 2 ;;
esac
# The lent machine returns only a few files: pack the logs into one.
tar -C "$OUT" -czf /tmp/kfa-logs.tgz --exclude='logs-*.tgz' . 2>/dev/null && mv /tmp/kfa-logs.tgz "$OUT/logs-$what.tgz"
find "$OUT" -type f ! -name 'logs-*.tgz' ! -name sdpa_compare.md ! -name sdpa_compare.csv -delete
exit $status

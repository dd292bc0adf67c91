#!/usr/bin/env bash
# Documents' non-finite values on one GPU: the new varlen test (every family the plan can run), then the suite.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x "$OUT"
[ -x /tmp/x/new/kfa_test_varlen ] || tar -xJf .device/iso.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
N=/tmp/x/new
t0=$(date +%s)
timeout 200 $N/kfa_test_varlen --gtest_filter='*EveryFamily*' > "$OUT/every_family.log" 2>&1
echo "every_family rc=$? $(( $(date +%s) - t0 )) s"
grep -E 'Failure|Which is|sequence [0-9]|opts.path|deterministic|OK|FAILED|PASSED' "$OUT/every_family.log" | head -60
t0=$(date +%s)
timeout 240 $N/kfa_test_varlen --gtest_filter='-*EveryFamily*' > "$OUT/varlen_rest.log" 2>&1
echo "varlen rest rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/varlen_rest.log"
if [ "${1:-}" = sanitize ]; then
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    timeout 200 compute-sanitizer --tool $tool $N/kfa_test_varlen \
      --gtest_filter='Varlen/bfloat16.AnotherSequencesNonFiniteRowsStayOutOfEveryFamily' > "$OUT/$tool.txt" 2>&1
    echo "$tool rc=$? $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/$tool.txt"
  done
fi

#!/usr/bin/env bash
# Status run at head dims 96 and 256: main's kfa_bench_sdpa against PyTorch SDPA (cuDNN, flash) in the same call.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/x /tmp/rows "$OUT"
tar -xJf .device/sdpa.tar.xz -C /tmp/x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
timeout 300 python3 perf/sdpa_compare.py --kfa-bench /tmp/x/new/kfa_bench_sdpa --out "$OUT/det" --rows /tmp/rows/det \
  --dtypes bf16,fp16 --d 96,256 --n 4096,16384 --causal 0,1 --reps 10 > "$OUT/det.log" 2> "$OUT/det.err"
echo "det rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 200 python3 perf/sdpa_compare.py --kfa-bench /tmp/x/new/kfa_bench_sdpa --out "$OUT/nondet" --rows /tmp/rows/nd \
  --dtypes bf16 --d 96,256 --n 4096,16384 --causal 0,1 --reps 10 --kfa-nondeterministic \
  > "$OUT/nondet.log" 2> "$OUT/nondet.err"
echo "nondet rc=$? $(( $(date +%s) - t0 )) s"
grep -v "^#row" "$OUT/det.log" | tail -30
grep -v "^#row" "$OUT/nondet.log" | tail -12

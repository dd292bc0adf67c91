#!/bin/bash
# kfa vs PyTorch CPU SDPA, same run: new (cpu38 4a9e592) and base (main 496f111) builds
cd /tmp/wt
P="/tmp/venv/bin/python perf/cpu_peer.py"
A="--n 2048,4096,8192 --d 64,128 --rounds 2 --reps 3 --markdown"
lscpu > /tmp/peer/lscpu.txt
for round in 1 2; do
  $P --build /tmp/bw $A --threads 1 --cpus 1 > /tmp/peer/native_new_r$round.md 2>&1
  $P --build /tmp/bmain $A --threads 1 --cpus 1 > /tmp/peer/native_base_r$round.md 2>&1
done
KFA_HOST_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 $P --build /tmp/bw3 $A --threads 1 --cpus 1 > /tmp/peer/avx2_new.md 2>&1
KFA_HOST_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 $P --build /tmp/bmain3 $A --threads 1 --cpus 1 > /tmp/peer/avx2_base.md 2>&1
$P --build /tmp/bw_omp $A --threads 2 --cpus 0,1 > /tmp/peer/omp2_new.md 2>&1
$P --build /tmp/bmain_omp $A --threads 2 --cpus 0,1 > /tmp/peer/omp2_base.md 2>&1
echo done > /tmp/peer/done.txt

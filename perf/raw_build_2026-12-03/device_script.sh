#!/usr/bin/env bash
# eti.sh build: configure the tree (precompiled kernels) and build everything with -j16 in the background, timed.
# eti.sh wait SECS | tests | consumer | ab ARGS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
R=$PWD; L=/tmp/kfa-logs; mkdir -p $L
K=(-DCMAKE_BUILD_TYPE=Release -DKokkos_ROOT=$R/.kokkos-cuda -DCMAKE_CXX_COMPILER=$R/.kokkos-cuda/bin/nvcc_wrapper
   -DCMAKE_CXX_EXTENSIONS=OFF -DKFA_ENABLE_KOKKOS_KERNELS=OFF -DKFA_ENABLE_NATIVE_ARCH=OFF)
G=""; command -v ninja >/dev/null && G="-G Ninja"
case "$1" in
build)
  nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "generator: ${G:-make}"
  s=$(date +%s)
  cmake $G -S . -B /tmp/bn "${K[@]}" -DKFA_ENABLE_MPI=ON -DKFA_ENABLE_HDF5=ON > $L/cfg-new.log 2>&1 || { tail -30 $L/cfg-new.log; exit 1; }
  echo "configure: $(( $(date +%s) - s )) s"; grep -n "kfa .*Kokkos\|NCCL\|HDF5\|sm_90a" $L/cfg-new.log | head
  setsid nohup bash -c "s=\$(date +%s); cmake --build /tmp/bn -j16 > $L/build-all.log 2>&1; echo rc=\$? wall=\$(( \$(date +%s) - s )) >> $L/build-all.log" > /dev/null 2>&1 &
  exec "$0" wait "${2:-500}" ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ $(date +%s) -lt $end ] && ! grep -q '^rc=' $L/build-all.log; do sleep 5; done
  tail -3 $L/build-all.log; grep -m5 -i " error" $L/build-all.log
  [ -f /tmp/bn/.ninja_log ] && awk 'NR>1{printf "%.1f %s\n", ($2-$1)/1000, $4}' /tmp/bn/.ninja_log | sort -rn | head -40 > $OUT/ninja_top.txt
  cp $L/*.log $OUT/ 2>/dev/null; true ;;
tests)
  shift
  for t in "$@"; do
    echo "== $t"; s=$(date +%s)
    if [ $t = kfa_test_ring ]; then
      for np in 1 2; do mpirun --allow-run-as-root --oversubscribe -np $np /tmp/bn/tests/$t > $OUT/$t-np$np.log 2>&1; echo "np=$np rc=$?"; grep -E '^\[  (PASSED|FAILED) ' $OUT/$t-np$np.log | sort | uniq -c; done
    else
      /tmp/bn/tests/$t > $OUT/$t.log 2>&1; rc=$?
      grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]' $OUT/$t.log | head -12; echo "rc=$rc ($(( $(date +%s) - s )) s)"
    fi
  done ;;
consumer)
  s=$(date +%s); cmake --install /tmp/bn --prefix /tmp/inst > $OUT/install.log 2>&1; echo "install rc=$? $(( $(date +%s) - s )) s"
  ls -la /tmp/inst/lib*/libkfa_core* 2>/dev/null
  env | grep NVCC_APPEND || echo "NVCC_APPEND_FLAGS not set"
  s=$(date +%s); cmake $G -S .gpu/consumer_bf16 -B /tmp/cb -Dkfa_ROOT=/tmp/inst -DKokkos_ROOT=$R/.kokkos-cuda -DCMAKE_CXX_COMPILER=$R/.kokkos-cuda/bin/nvcc_wrapper -DCMAKE_CXX_EXTENSIONS=OFF > $OUT/cb-cfg.log 2>&1; echo "consumer configure rc=$? $(( $(date +%s) - s )) s"
  rm -rf /tmp/cb/CMakeFiles/consumer_bf16.dir; s=$(date +%s); cmake --build /tmp/cb -v > $OUT/cb-build.log 2>&1; echo "consumer build rc=$? $(( $(date +%s) - s )) s"; grep -c "sm_90a" $OUT/cb-build.log
  /tmp/cb/consumer_bf16 ;;
ab)
  shift
  export LD_LIBRARY_PATH=$R/.gpu/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  for rep in 1 2; do for who in base new; do
    if [ $who = base ]; then b=.gpu/bin/kfa_bench_sdpa_new; else b=/tmp/bn/perf/kfa_bench_sdpa; fi
    mkdir -p /tmp/ab-$who-$rep; echo "== $who rep $rep"; $b --out /tmp/ab-$who-$rep "$@" > $OUT/ab-$who-$rep.txt 2>&1; echo rc=$?
  done; done ;;
bitwise)
  n=0; bad=0
  for f in /tmp/ab-base-1/*; do n=$((n+1)); cmp -s "$f" /tmp/ab-new-1/$(basename $f) || { bad=$((bad+1)); echo "DIFFERS: $(basename $f)"; }; done
  echo "bitwise: $n files compared, $bad differ"; ls /tmp/ab-base-1 | head -5 ;;
esac

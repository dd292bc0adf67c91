#!/bin/bash
# usage: abpf.sh BIN rounds args...
bin=$1; r=$2; shift 2
for i in $(seq $r); do
  for v in 0 1; do
    KFA_EXP_SPREAD=$v taskset -c 1 $bin "$@" --no-reference 2>&1 | grep -E '^ +[0-9]' | sed "s/^/spread=$v /"
  done
done

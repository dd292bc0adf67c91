#!/bin/bash
# usage: abord.sh BIN rounds "variants" args...
bin=$1; r=$2; vs=$3; shift 3
for i in $(seq $r); do
  for v in $vs; do
    KFA_EXP_ORDER=$v taskset -c 1 $bin "$@" --no-reference 2>&1 | grep -E '^ +[0-9]' | sed "s/^/v=$v /"
  done
done

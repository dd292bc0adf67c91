#!/bin/bash
# usage: abenv.sh VAR BIN rounds "variants" args...
var=$1; bin=$2; r=$3; vs=$4; shift 4
for i in $(seq $r); do
  for v in $vs; do
    env $var=$v taskset -c 1 $bin "$@" --no-reference 2>&1 | grep -E '^ +[0-9]' | sed "s/^/v=$v /"
  done
done

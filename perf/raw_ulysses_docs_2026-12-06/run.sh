#!/bin/bash
# Ulysses vs the ring over packed documents, kfa-longseq, 2 ranks (one core each), float32, causal,
# forward+backward, log-normal documents (median 1024, sigma 1, in [128, 16384], seed 7) filling the sequence.
# Rounds interleaved: every configuration once per round. Usage: [KFA_HOST_ISA=avx2] run.sh BUILD_DIR OUT
B=$1; OUT=$2; shift 2
APP=$B/apps/kfa-longseq/kfa-longseq
: > "$OUT"
for round in 1 2 3; do
  for cfg in "16384 4 4 64" "16384 8 2 128"; do
    set -- $cfg
    for lay in zigzag contiguous; do
      for sp in ring ulysses auto; do
        mpirun --allow-run-as-root --bind-to core -n 2 $APP --generate --seqlen $1 --heads $2 \
          --kv-heads $3 --head-dim $4 --dtype float32 --layout $lay --causal --backward \
          --doc-lognormal 1024 1 128 16384 7 --sp $sp --json /tmp/ud.json > /dev/null 2>&1 ||
          echo "FAILED $cfg $lay $sp"
        python3 - "$round" "$cfg" "$lay" "$sp" >> "$OUT" <<'P'
import json, sys
j = json.load(open('/tmp/ud.json'))
print(sys.argv[1], sys.argv[2].replace(' ', 'x'), sys.argv[3], sys.argv[4], j['sp'], j['ulysses_degree'],
      j['documents'], j['compute_s'], j['load_imbalance_s'], j['a2a_to_heads_s'], j['a2a_to_sequence_s'], sep=' ')
P
      done
    done
  done
done

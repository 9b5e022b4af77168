#!/usr/bin/env bash
# A CONTEXT-token prefill of the native step (scripts/perf/native_forward.py, one prefill) under `perf record`,
# and the share of the step's kernels' samples that attention's take (attention_share; with the OpenMP
# runtime's waits at the step's barriers counted in: attention_share_with_waits).
# Prints native_forward.py's JSON with attention_share added.
# Usage: scripts/perf/prefill_profile.sh MODEL CONTEXT [int16|int8]   (PYTHON, PERF_DATA: where and with what)
set -euo pipefail
model=$1 context=$2 activations=${3:-int16}
python=${PYTHON:-python} data=${PERF_DATA:-$(mktemp /tmp/prefill-perf.XXXXXX)}
here=$(cd "$(dirname "$0")" && pwd)
json=$(perf record -q -F 199 -o "$data" -- "$python" "$here/native_forward.py" "$model" "$context" 1 "$activations" 1 2>/dev/null | tail -1)
perf report -i "$data" --no-children --sort dso,symbol --stdio 2>/dev/null | awk -v json="$json" '
  /^ +[0-9.]+%/ { p = $1 + 0
    if ($2 ~ /stratum_step/) step += p
    if ($2 ~ /libgomp/) wait += p
    if ($2 ~ /stratum_step/ && $0 ~ /attend|rows_scores|block_scores|block_values|online_softmax|ordered_sums|plain_scores|plain_values/) attn += p }
  END { sub(/}$/, "", json); share = attn / step; with_waits = attn / (step + wait)
        printf "%s, \"attention_share\": %.3f, \"attention_share_with_waits\": %.3f}\n", json, share, with_waits }'

#!/usr/bin/env bash
# The serving benchmark against two layouts of this checkout's engine — in its own process (the
# default) and in a thread of the server — and, when BEFORE points at another checkout, against that
# code too: one run, the same seeded workloads, side by side (the closing figures of a layout change).
# Each workload runs twice, the second time with the targets in reverse order, so that a target's
# place in the run does not pass for a difference between them.
# Usage: [BEFORE=/path/to/other/checkout] scripts/bench_engine_layout.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-bench-results/layout}
STRATUM=.venv/bin/stratum
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
# up, and no cold start's kernels still being prepared (a switch mid-run would drop the prefix cache)
wait_up() { until curl -sf "$1/health" 2>/dev/null | grep -qv '"preparing"'; do sleep 0.2; done; }

targets=(process http://127.0.0.1:8401 thread http://127.0.0.1:8402)
$STRATUM serve --port 8401 --engine process >"$OUT/process.log" 2>&1 & pids+=($!)
$STRATUM serve --port 8402 --engine thread >"$OUT/thread.log" 2>&1 & pids+=($!)
if [ -n "${BEFORE:-}" ]; then
  # Run from BEFORE itself, so that `-m stratum.cli` imports that code; with a home of its own for
  # its native kernels (the same sources at another path are rebuilt), sharing the models, the
  # converted checkpoints and the measured kernel plans.
  home=${STRATUM_HOME:-$HOME/.cache/stratum}
  bhome=$(realpath -m "$OUT/before-home")
  mkdir -p "$bhome/kernels"
  ln -sfn "$home/models" "$bhome/models"
  ln -sfn "$home/cache" "$bhome/cache"
  cp "$home"/kernels/*.json "$bhome/kernels/" 2>/dev/null || true
  (cd "$BEFORE" && STRATUM_HOME=$bhome exec "$ROOT/.venv/bin/python" -m stratum.cli serve --port 8403) \
    >"$OUT/before.log" 2>&1 & pids+=($!)
  targets=(before http://127.0.0.1:8403 "${targets[@]}")
fi
for ((i = 1; i < ${#targets[@]}; i += 2)); do wait_up "${targets[i]}"; done

run() {  # name workload concurrency max_tokens num_requests seed extra...
  local name=$1 workload=$2 conc=$3 max_tokens=$4 num=$5 seed=$6; shift 6
  local forward=() reverse=()
  for ((i = 0; i < ${#targets[@]}; i += 2)); do
    forward+=(--url "${targets[i+1]}" --label "${targets[i]}")
    reverse=(--url "${targets[i+1]}" --label "${targets[i]}" "${reverse[@]}")
  done
  for order in forward reverse; do  # a seed per pass: no pass finds the other's prompts in the caches
    local -n urls=$order
    [ "$order" = reverse ] && seed=$((seed + 100))
    $STRATUM bench compare --api openai --model smollm2-135m "${urls[@]}" \
      --workload "$workload" --concurrency "$conc" --max-tokens "$max_tokens" --num-requests "$num" --ignore-eos \
      --no-progress --seed "$seed" --markdown "$OUT/$name-$order.md" "$@" >"$OUT/$name-$order.json"
    cat "$OUT/$name-$order.md"
  done
}
run single-stream unique 1 128 8 11
run unique-c16 unique 16 128 48 12
run shared-prefix-c32 shared-prefix 32 64 64 13
echo "results in $OUT"

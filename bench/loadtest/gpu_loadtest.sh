#!/usr/bin/env bash
# The locust load test (loadtest/locustfile.py) against SGLang + sgl_sparse on the lent
# GPU, in one device command: random-weights model with a word-level tokenizer, server
# in the background, locust on the same machine (the device is offline), server stopped.
# Setup and device calls: bench/loadtest/README.md.
#
#   bash bench/loadtest/gpu_loadtest.sh
#
# Environment (defaults in brackets):
#   SHAPE [qwen3-1.7b]  MODEL [/root/model-lt, made if absent]  MAX_POS [32768]
#   USERS [32]  RUN_TIME [3m]  POLICY_MIX [full,streaming:window=1024,sadas:window=1024]
#   LOCUST_ARGS: more locust arguments (lengths, thresholds, --scenarios, ...)
#   SERVER_FLAGS [--mem-fraction-static 0.85 --disable-prefill-cuda-graph --enable-metrics]
#   PY [python3]  SITE [/tmp/site: SGLang wheelhouse]  LOCUST_SITE [/tmp/lt-site]  PORT [30000]
#   OUT [/tmp/out]: server.log, locust.log, lt_stats.csv (+ _failures, _history), lt.html,
#   lt_summary.json, server_info_after.json
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SHAPE="${SHAPE:-qwen3-1.7b}"; MODEL="${MODEL:-/root/model-lt}"; MAX_POS="${MAX_POS:-32768}"
USERS="${USERS:-32}"; RUN_TIME="${RUN_TIME:-3m}"
POLICY_MIX="${POLICY_MIX:-full,streaming:window=1024,sadas:window=1024}"
SERVER_FLAGS="${SERVER_FLAGS:---mem-fraction-static 0.85 --disable-prefill-cuda-graph --enable-metrics}"
PY="${PY:-python3}"; SITE="${SITE:-/tmp/site}"; LOCUST_SITE="${LOCUST_SITE:-/tmp/lt-site}"
PORT="${PORT:-30000}"; URL="http://127.0.0.1:$PORT"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" PYTHONUNBUFFERED=1

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [[ ! -f "$MODEL/config.json" ]]; then
    PYTHONPATH="$SITE" "$PY" bench/gpu/make_random_model.py --shape "$SHAPE" --out "$MODEL" --max-pos "$MAX_POS" || exit 1
fi
if [[ ! -f "$MODEL/tokenizer.json" ]]; then
    PYTHONPATH="$SITE" "$PY" bench/loadtest/add_tokenizer.py "$MODEL" || exit 1
fi

# shellcheck disable=SC2086  # SERVER_FLAGS is a list of flags
PYTHONPATH="$SITE" setsid "$PY" -m sglang.launch_server --model-path "$MODEL" --attention-backend sgl_sparse \
    --port "$PORT" --sparse-config bench/gpu/sparse_config.yaml $SERVER_FLAGS >"$OUT/server.log" 2>&1 &
server=$!
stop_server() { kill -TERM -- "-$server" 2>/dev/null; sleep 5; kill -KILL -- "-$server" 2>/dev/null; }
trap stop_server EXIT

health() { "$PY" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$URL/health', timeout=5).status != 200)" 2>/dev/null; }
t0=$SECONDS
until health; do
    if ! kill -0 "$server" 2>/dev/null; then echo "server exited during start-up"; tail -40 "$OUT/server.log"; exit 1; fi
    if (( SECONDS - t0 > 480 )); then echo "server not healthy after 480 s"; tail -40 "$OUT/server.log"; exit 1; fi
    sleep 2
done
echo "server ready in $((SECONDS - t0)) s"

# shellcheck disable=SC2086  # LOCUST_ARGS is a list of arguments
PYTHONPATH="$LOCUST_SITE" "$PY" -m locust -f loadtest/locustfile.py --headless --host "$URL" \
    -u "$USERS" -r "$USERS" -t "$RUN_TIME" --stop-timeout 120 --only-summary --seed 0 \
    --policy-mix "$POLICY_MIX" --csv "$OUT/lt" --html "$OUT/lt.html" --summary-json "$OUT/lt_summary.json" \
    ${LOCUST_ARGS:-} 2>&1 | tee "$OUT/locust.log"
rc=${PIPESTATUS[0]}

# Per-request sgl_sparse state after the traffic (aborts included): expect 0 active.
sleep 5
"$PY" -c "import urllib.request; print(urllib.request.urlopen('$URL/get_server_info', timeout=30).read().decode())" \
    >"$OUT/server_info_after.json" 2>&1
"$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print('sgl_sparse after the run:', [s.get('sgl_sparse') for s in d['internal_states']])" \
    "$OUT/server_info_after.json"
# The device returns at most 8 files from $OUT: the locust CSVs travel as one archive,
# so the server log and the state check come back too.
tar -czf "$OUT/lt_csv.tar.gz" -C "$OUT" $(cd "$OUT" && ls lt_*.csv) && rm -f "$OUT"/lt_*.csv
echo "locust exit code $rc"
exit "$rc"

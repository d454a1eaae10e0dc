#!/usr/bin/env bash
# Starts `pagoda serve` with the given engine flags, waits for it, runs `pagoda bench serve` with BENCH_ARGS, and
# stops the server. Example (an H200, random Llama-3-8B weights):
#   BENCH_ARGS="--num-requests 256 --request-rate inf --vocab-size 128256" \
#     benchmarks/serve_local.sh --preset llama-3-8b
set -euo pipefail
PORT=${PORT:-8000}
PY=${PYTHON:-python3}
$PY -m deploy.cli serve --port "$PORT" "$@" > "${SERVE_LOG:-/tmp/pagoda-serve.log}" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 ${WAIT_S:-300}); do
  $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -40 "${SERVE_LOG:-/tmp/pagoda-serve.log}"; exit 1; }
  sleep 1
done
# /health answers once the ingress is up; wait until a model replica completes a request too.
for _ in $(seq 1 ${WAIT_S:-300}); do
  $PY - "$PORT" <<'PYEOF' 2>/dev/null && break
import json, sys, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=5))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": [11, 12, 13], "max_tokens": 1}).encode()
req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=30)
PYEOF
  sleep 1
done
IFS=';' read -ra runs <<< "${BENCH_ARGS:---num-requests 64}"
for run in "${runs[@]}"; do
  # shellcheck disable=SC2086
  $PY -m benchmarks serve --url "http://127.0.0.1:$PORT" $run
done

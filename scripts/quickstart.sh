#!/usr/bin/env bash
# Quick start on CPU, loopback only: builds if needed, starts two worker replicas of a tiny
# Intern-S2-Mobius model with dummy weights (the Qwen3 tokenizer's vocabulary, so that text
# works), one router in front of them, streams a chat completion through the OpenAI endpoint,
# prints a few lines of the worker's /metrics, and shuts everything down (SIGTERM: drain).
#
#   bash scripts/quickstart.sh [TOKENIZER_DIR]     (default ../shared/fixtures/tokenizer-qwen3)
set -euo pipefail
cd "$(dirname "$0")/.."
tokenizer=${1:-../shared/fixtures/tokenizer-qwen3}
[ -f "$tokenizer/tokenizer.json" ] || { echo "no tokenizer.json in $tokenizer" >&2; exit 2; }

if [ ! -x build/bin/mobius-router ] || [ ! -x build/bin/mobius-worker ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j2 --target mobius-worker mobius-router
fi

base=${MOBIUS_QUICKSTART_PORT:-47100}
logs=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "logs: $logs"
}
trap cleanup EXIT

for i in 0 1; do
  build/bin/mobius-worker --config configs/tiny-mobius-qwen3-vocab.json --load-format dummy \
    --served-model-name tiny --tokenizer "$tokenizer" --host 127.0.0.1 --port $((base + i)) \
    --metrics-port $((base + 10 + i)) >"$logs/worker$i.log" 2>&1 &
  pids+=($!)
done
build/bin/mobius-router --worker 127.0.0.1:$base --worker 127.0.0.1:$((base + 1)) \
  --host 127.0.0.1 --grpc-port $((base + 20)) --http-port $((base + 21)) \
  --tokenizer "$tokenizer" --served-model-name tiny >"$logs/router.log" 2>&1 &
pids+=($!)

http=http://127.0.0.1:$((base + 21))
for _ in $(seq 1 100); do
  curl -sf "$http/health" >/dev/null 2>&1 && break
  sleep 0.2
done
curl -sf "$http/health" >/dev/null || { echo "router not healthy; see $logs" >&2; exit 1; }

echo "== streaming a chat completion from $http/v1/chat/completions (dummy weights: the text is noise)"
curl -sN "$http/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "tiny",
  "messages": [{"role": "user", "content": "Say hello in three words."}],
  "max_tokens": 12, "temperature": 0, "stream": true,
  "stream_options": {"include_usage": true}}'
echo
echo "== structured output: the same noise, held to a JSON schema (response_format)"
curl -s "$http/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "tiny",
  "messages": [{"role": "user", "content": "Greet me as JSON."}],
  "max_tokens": 200, "temperature": 0,
  "response_format": {"type": "json_schema", "json_schema": {"name": "greeting", "schema": {
    "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 24},
    "words": {"type": "integer"}}, "required": ["greeting", "words"]}}}}'
echo
echo "== a few lines of the workers' /metrics"
for i in 0 1; do
  curl -s "http://127.0.0.1:$((base + 10 + i))/metrics" |
    grep -E '^vllm:(generation_tokens_total|num_requests_running|time_to_first_token_seconds_count)'
done
echo "== and of the router's"
curl -s "$http/metrics" |
  grep -E '^(mobius_router_(requests_total|replica_healthy)|vllm:time_to_first_token_seconds_count)'
echo "== shutting down (SIGTERM drains)"

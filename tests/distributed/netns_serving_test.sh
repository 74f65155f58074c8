#!/usr/bin/env bash
# A replica of two mobius-worker ranks (--tp 2) in two network namespaces joined by a veth pair,
# each with its own address, as on two nodes: the rendezvous, the UCX collectives and the step
# plans cross the link; mobius-router (beside rank 0) serves an OpenAI completion from it, which
# must equal `mobius generate`'s greedy tokens (one process).
# Usage: netns_serving_test.sh WORKER ROUTER CLI MODEL_DIR. Needs root, iproute2 and python3;
# exits 77 (ctest: skipped) when network namespaces cannot be made here.
set -u
worker="$1" router="$2" cli="$3" model="$4"
# shellcheck source=tests/distributed/netns_lib.sh
source "$(dirname "$0")/netns_lib.sh" 253

export UCX_TLS=tcp
common=(--model "$model" --threads=1 --max-model-len=256 --tp=2 --world-size=2
        --leader="$ip_a:29500" --rendezvous-timeout-s=30)
ip netns exec "$a" "$worker" "${common[@]}" --rank=0 --host=0.0.0.0 --port=50051 \
  >"$dir/rank0.log" 2>&1 &
pids+=($!)
ip netns exec "$b" "$worker" "${common[@]}" --rank=1 --host=0.0.0.0 --port=50052 \
  >"$dir/rank1.log" 2>&1 &
pids+=($!)
ip netns exec "$a" "$router" --worker=127.0.0.1:50051 --host=127.0.0.1 --http-port=8080 \
  --grpc-port=8081 --health-check-interval-ms=50 >"$dir/router.log" 2>&1 &
pids+=($!)

prompt="5,77,1024,9,300,12"
expected=$("$cli" generate --model "$model" --prompt-ids "$prompt" --max-tokens 6 --ignore-eos \
  --threads 1 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])')
got=$(ip netns exec "$a" python3 - "$prompt" <<'PY'
import json, sys, time, urllib.request
prompt = [int(x) for x in sys.argv[1].split(",")]
body = json.dumps({"model": "intern-s2-mobius-tiny", "prompt": prompt, "max_tokens": 6,
                   "temperature": 0, "ignore_eos": True, "logprobs": 0}).encode()
deadline = time.time() + 60
while True:
    try:
        req = urllib.request.Request("http://127.0.0.1:8080/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=30))
        break
    except Exception as e:  # not up yet: the router answers 503 until the replica is healthy
        if time.time() > deadline:
            print("no answer: %s" % e)
            sys.exit(0)
        time.sleep(0.2)
labels = out["choices"][0]["logprobs"]["tokens"]
print([int(s.split(":", 1)[1]) for s in labels])
PY
)
echo "expected (one process): $expected"
echo "got (2 ranks, 2 namespaces): $got"
if [ -n "$expected" ] && [ "$expected" = "$got" ] && grep -q "following the leader" "$dir/rank1.log"; then
  echo "PASS: ranks in namespaces $a ($ip_a) and $b ($ip_b) served the request"
  exit 0
fi
cat "$dir/rank0.log" "$dir/rank1.log" "$dir/router.log"
echo "FAIL"
exit 1

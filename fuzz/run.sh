#!/usr/bin/env bash
# Builds the fuzz targets and runs each for a bounded time; fails on any crash
# (or broken invariant) and prints the crashing input. Used by .ci/run.
#
#   bash fuzz/run.sh                      # every target, 60 s each
#   FUZZ_SECONDS=300 bash fuzz/run.sh kv_payload
#
# Environment: FUZZ_SECONDS (per target, default 60), FUZZ_SANITIZER (none,
# address, ...; default none: the product forbids unsafe code, so the sanitizer
# mostly costs speed), FUZZ_ARGS (extra libFuzzer flags).
#
# Stable Rust: cargo-fuzz passes nightly-only rustc flags (-Zsanitizer=... and
# friends); RUSTC_BOOTSTRAP=1 lets the stable compiler take them. New inputs go
# to fuzz/corpus/<target>/ (git-ignored); the committed seeds in
# fuzz/seeds/<target>/ are only read.
set -euo pipefail
cd "$(dirname "$0")"

CARGO_FUZZ_VERSION=0.13.2
SECONDS_EACH="${FUZZ_SECONDS:-60}"
SANITIZER="${FUZZ_SANITIZER:-none}"
export RUSTC_BOOTSTRAP=1
# The fuzz crate is a workspace of its own, built into fuzz/target.
unset CARGO_TARGET_DIR

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

started=$(date +%s)
cargo fmt --check
cargo fuzz build --sanitizer "$SANITIZER"
echo "fuzz: built in $(($(date +%s) - started)) s"

failed=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    dict=()
    [ -f "dicts/$t.dict" ] && dict=("-dict=dicts/$t.dict")
    log="artifacts/$t/run.log"
    echo "fuzz: $t for ${SECONDS_EACH} s"
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    if cargo fuzz run --sanitizer "$SANITIZER" "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
        -print_final_stats=1 "${dict[@]}" ${FUZZ_ARGS:-} >"$log" 2>&1; then
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)|^Done ' "$log" | sed "s/^/fuzz: $t: /" || true
    else
        failed+=("$t")
        tail -n 60 "$log"
        crash=$(grep -o 'Test unit written to [^ ]*' "$log" | head -n 1 | sed 's/Test unit written to //')
        echo "fuzz: $t FAILED; crashing input: ${crash:-<none written, see fuzz/$log>}"
        [ -n "$crash" ] && echo "fuzz: reproduce with: RUSTC_BOOTSTRAP=1 cargo fuzz run -s $SANITIZER $t $crash (in fuzz/)"
    fi
done

echo "fuzz: done in $(($(date +%s) - started)) s"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz: crashes in: ${failed[*]}" >&2
    exit 1
fi

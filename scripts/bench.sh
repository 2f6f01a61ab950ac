#!/usr/bin/env bash
# Runs the benchmark on a release build: builds every binary, then `agentscope-bench` with the
# arguments given (JSON on stdout, a summary on stderr). See docs/BENCHMARKS.md.
#
#   scripts/bench.sh --rounds 3 all > bench.json
#   scripts/bench.sh low --tasks 50
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd -P)"
cd "$ROOT"
scripts/ensure-deps.sh >/dev/null
# shellcheck disable=SC1091
. .run/env
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/agentscope/target}"
if [ -z "${AGENTSCOPE_BENCH_NO_BUILD:-}" ]; then
    cargo build --release --workspace --bins --locked -q >&2
fi
export AGENTSCOPE_BIN_DIR="$CARGO_TARGET_DIR/release"
exec "$AGENTSCOPE_BIN_DIR/agentscope-bench" "$@"

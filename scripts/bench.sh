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
# The stacks' directories (task directories, NATS store, logs): a fresh one on tmpfs when the
# machine has one with room, unless AGENTSCOPE_TEST_DIR names one. On this machine kind's root
# filesystem (ext4 without a journal, mounted with `discard`) creating inodes near recently
# deleted ones gets slower run after run, which the host's figures would measure
# (docs/BENCHMARKS.md, "Session 7"). 0755: the attempts' uids must reach the shared directory.
if [ -z "${AGENTSCOPE_TEST_DIR:-}" ]; then
    free_kb="$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')"
    if [ -n "$free_kb" ] && [ "$free_kb" -gt $((4 * 1024 * 1024)) ]; then
        AGENTSCOPE_TEST_DIR="$(mktemp -d /dev/shm/agentscope-bench.XXXXXX)"
        chmod 755 "$AGENTSCOPE_TEST_DIR"
        export AGENTSCOPE_TEST_DIR
        trap 'rm -rf "$AGENTSCOPE_TEST_DIR"' EXIT
    fi
fi
"$AGENTSCOPE_BIN_DIR/agentscope-bench" "$@"

#!/usr/bin/env bash
# The test command (README.md): installs what the tests need, builds, checks style and runs the
# whole suite against real nats-server and PostgreSQL processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-deps.sh >/dev/null
# shellcheck disable=SC1091
. .run/env
# The real provider CLIs (Claude Code, Codex, opencode, OpenClaw) at pinned versions, from npm.
scripts/install-providers.sh >/dev/null
# shellcheck disable=SC1091
. "${AGENTSCOPE_PROVIDERS_DIR:-$HOME/.cache/agentscope/providers}/env"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/agentscope/target}"
export CARGO_TERM_COLOR=never
echo "== fmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== build"
cargo build --workspace --bins --locked
echo "== test"
cargo test --workspace --locked --no-fail-fast

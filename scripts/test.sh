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
. "${AGENTSCOPE_PROVIDERS_DIR:-/opt/agentscope/providers}/env"
# schemathesis (pinned, from PyPI, in a venv under $HOME/.cache/agentscope): the system test
# api_contract::schemathesis_finds_no_failure_against_the_served_document fuzzes the gateway's
# served OpenAPI document with it (response-schema and status-code conformance, bounded in
# examples and time).
scripts/install-schemathesis.sh >/dev/null
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/agentscope/target}"
export CARGO_TERM_COLOR=never
echo "== fmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== build"
cargo build --workspace --bins --locked
echo "== test"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
# One closing line for the whole run, summed over every test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$log"
exit "$status"

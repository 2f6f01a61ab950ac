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
# The sentinel is no cargo target (svc-host's build.rs compiles it with panic=abort): the same
# two checks on it.
echo "== sentinel (fmt, clippy)"
rustfmt --edition 2024 --check svc-host/sentinel/main.rs svc-host/sentinel/args.rs
mkdir -p "$CARGO_TARGET_DIR/sentinel-clippy"
clippy-driver --edition 2024 --crate-type bin --crate-name agentscope_sentinel -C panic=abort \
    -C relocation-model=static -C link-arg=-nostartfiles -C link-arg=-nostdlib \
    -C link-arg=-static -D warnings svc-host/sentinel/main.rs \
    -o "$CARGO_TARGET_DIR/sentinel-clippy/agentscope-sentinel"
echo "== build"
cargo build --workspace --bins --locked
echo "== test"
# cargo-nextest (.config/nextest.toml): one line per test with its time, SLOW for a test running
# longer than a minute; then the slowest tests and one closing line for the whole run.
# nextest writes its report under the workspace root (its default store dir, target/nextest).
junit="target/nextest/default/junit.xml"
rm -f "$junit"
status=0
if ! cargo nextest --version >/dev/null 2>&1; then
    # Without cargo-nextest: the same tests, without per-test times.
    echo "cargo-nextest is not installed; running cargo test (no per-test times)"
    log="$(mktemp)"
    trap 'rm -f "$log"' EXIT
    cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
    awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
         END { printf "%d passed, %d failed\n", p, f }' "$log"
    exit "$status"
fi
cargo nextest run --workspace --locked --no-fail-fast || status=$?
python3 - "$junit" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    cases = []
failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = [c for c in cases if c.find("skipped") is not None]
slowest = sorted(cases, key=lambda c: float(c.get("time", 0)), reverse=True)[:15]
if slowest:
    print("== slowest tests")
    for c in slowest:
        print(f"{float(c.get('time', 0)):9.1f} s  {c.get('classname')} {c.get('name')}")
print(f"{len(cases) - len(failed) - len(skipped)} passed, {len(failed)} failed")
PY
exit "$status"

#!/usr/bin/env bash
# install-schemathesis.sh: install schemathesis (from PyPI, pinned) into a virtualenv outside the
# repository, $HOME/.cache/agentscope/schemathesis-$VERSION, for the API fuzzing step of the test
# command (tests/system/api_fuzz.rs). Idempotent: a venv already at the pinned version is kept
# without touching the network. Prints one line, `SCHEMATHESIS=/abs/path/to/st`; pip's output is
# shown only when it fails.
#
# Usage:  scripts/install-schemathesis.sh
set -euo pipefail

VERSION=4.32.5
VENV="${AGENTSCOPE_SCHEMATHESIS_VENV:-$HOME/.cache/agentscope/schemathesis-$VERSION}"
ST="$VENV/bin/st"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

if [ -x "$ST" ] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('schemathesis') != '$VERSION')" 2>/dev/null; then
    echo "SCHEMATHESIS=$ST"
    exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
mkdir -p "$(dirname "$VENV")"
# A half-made venv from an interrupted run is made again.
rm -rf "$VENV"
if ! { "$PYTHON" -m venv "$VENV" && "$VENV/bin/pip" install --quiet "schemathesis==$VERSION"; } >"$log" 2>&1; then
    echo "install-schemathesis: installing schemathesis==$VERSION failed:" >&2
    cat "$log" >&2
    rm -rf "$VENV"
    exit 1
fi
echo "SCHEMATHESIS=$ST"

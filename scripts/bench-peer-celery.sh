#!/usr/bin/env bash
# The Celery peer of agentscope-bench's W1 low load and bulk (docs/BENCHMARKS.md): Celery 5 with
# the machine's Redis on 127.0.0.1:6379, a threads pool of 16, installed from PyPI into a venv
# under the cache directory on first use.
#
#   scripts/bench-peer-celery.sh --rounds 3 all > celery.json
#   scripts/bench-peer-celery.sh low --low-tasks 200 [--spawn]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd -P)"
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/agentscope/bench-peer-celery"
if [ ! -x "$VENV/bin/celery" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "celery[redis]>=5,<6" >&2
fi
cd "$ROOT/scripts"
exec "$VENV/bin/python" bench_peer_celery.py "$@"

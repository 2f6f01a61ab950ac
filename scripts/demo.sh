#!/usr/bin/env bash
# Starts the whole system on this machine (its own nats-server and database, the four services
# and a local host) and runs a demo task end to end, printing its events as they happen.
#
#   scripts/demo.sh          run the demo, then stop everything
#   scripts/demo.sh --keep   leave the system running afterwards (stop it with scripts/demo.sh --stop)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd -P)"
cd "$ROOT"
RUN="${AGENTSCOPE_DEMO_DIR:-$ROOT/.run/demo}"
KEEP=0
case "${1:-}" in
--keep) KEEP=1 ;;
--stop)
    [ -f "$RUN/pids" ] && while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$RUN/pids"
    rm -f "$RUN/pids"
    echo "demo stopped"
    exit 0
    ;;
"") ;;
*) echo "usage: scripts/demo.sh [--keep|--stop]" >&2; exit 2 ;;
esac

say() { printf '\n== %s\n' "$*"; }
scripts/ensure-deps.sh >/dev/null
# shellcheck disable=SC1091
. .run/env
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/agentscope/target}"
if [ -n "${AGENTSCOPE_BIN_DIR:-}" ]; then
    BIN="$AGENTSCOPE_BIN_DIR" # already built (the test suite runs the demo this way)
else
    say "building (first run takes a few minutes)"
    cargo build --workspace --bins --locked -q
    BIN="$CARGO_TARGET_DIR/debug"
fi

[ -f "$RUN/pids" ] && "$0" --stop >/dev/null
rm -rf "$RUN" && mkdir -p "$RUN"
NATS_PORT="${AGENTSCOPE_DEMO_NATS_PORT:-4229}"
API_PORT="${AGENTSCOPE_DEMO_API_PORT:-8080}"
DB="${AGENTSCOPE_DEMO_DB:-agentscope_demo}"
ADMIN_TOKEN="demo-admin-token-$(date +%s)"
export AGENTSCOPE_API="http://127.0.0.1:$API_PORT"

cleanup() {
    if [ "$KEEP" = 0 ] && [ -f "$RUN/pids" ]; then
        while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$RUN/pids"
        rm -f "$RUN/pids"
        PGOPTIONS="--client-min-messages=warning" psql -q -h 127.0.0.1 -U postgres -d postgres \
            -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT
start() { # name, then the command; output goes to .run/demo/NAME.log
    local name=$1
    shift
    "$@" >"$RUN/$name.log" 2>&1 &
    echo $! >>"$RUN/pids"
}
wait_ok() { # what, command...
    local what=$1
    shift
    for _ in $(seq 1 150); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    echo "demo: $what did not come up; see $RUN/*.log" >&2
    exit 1
}

say "starting nats-server (JetStream, authentication on) on 127.0.0.1:$NATS_PORT and database $DB"
# Services connect with their own passwords; hosts and workers with their tokens, checked by the
# scheduler's auth callout (ARCHITECTURE.md, Security).
rm -rf "$RUN/nats-auth"
"$BIN/agentscope" nats-auth --dir "$RUN/nats-auth" >/dev/null
cat >"$RUN/nats.conf" <<EOF
listen: "127.0.0.1:$NATS_PORT"
jetstream { store_dir: "$RUN/nats" }
include "nats-auth/auth.conf"
EOF
# Half the cores for Go's scheduler, at least one (unless GOMAXPROCS is set): on a machine it
# shares with PostgreSQL and the services, nats-server spends less CPU spinning for work
# (docs/BENCHMARKS.md, session 37; the test harness does the same).
NATS_PROCS=${GOMAXPROCS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
start nats env GOMAXPROCS="$NATS_PROCS" "$AGENTSCOPE_NATS_SERVER" -c "$RUN/nats.conf"
PGOPTIONS="--client-min-messages=warning" psql -q -h 127.0.0.1 -U postgres -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
export AGENTSCOPE_NATS_URL="nats://127.0.0.1:$NATS_PORT"
export AGENTSCOPE_DATABASE_URL="postgres://postgres@127.0.0.1:5432/$DB"
wait_ok nats-server bash -c "exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT"

say "starting svc-scheduler, svc-gateway (:$API_PORT) and svc-dataplane"
nats_as() { # service: its NATS user and password file
    echo "AGENTSCOPE_NATS_USER=$1 AGENTSCOPE_NATS_PASSWORD_FILE=$RUN/nats-auth/$1.password"
}
# shellcheck disable=SC2046
start scheduler env $(nats_as scheduler) AGENTSCOPE_NATS_CALLOUT_SEED_FILE="$RUN/nats-auth/callout.seed" \
    AGENTSCOPE_HEALTH_ADDR=127.0.0.1:0 "$BIN/svc-scheduler"
# shellcheck disable=SC2046
start gateway env $(nats_as gateway) AGENTSCOPE_HTTP_ADDR="127.0.0.1:$API_PORT" \
    AGENTSCOPE_ADMIN_TOKEN="$ADMIN_TOKEN" "$BIN/svc-gateway"
# shellcheck disable=SC2046
start dataplane env $(nats_as dataplane) AGENTSCOPE_HEALTH_ADDR=127.0.0.1:0 "$BIN/svc-dataplane"
wait_ok svc-gateway "$BIN/agentscope" health

cli() { "$BIN/agentscope" "$@"; }
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

say "creating a workspace, a pool, a runtime profile, an agent and its binding"
AGENTSCOPE_TOKEN=$(cli --json workspace create demo --admin-token "$ADMIN_TOKEN" | json "['api_token']")
export AGENTSCOPE_TOKEN
HOST_TOKEN=$(cli --json host-token create demo-host | json "['token']")
cli pools create demo-pool
cli profiles create demo-command --provider command \
    --command sh --command -c --command 'echo "working on: $(head -1 "$AGENTSCOPE_INPUT_DIR/ISSUE.md")"; echo "branch file: $(cat FEATURE.txt)"; git log --oneline | head -3; echo done'
cli agents create demo-agent --provider command --instructions "Run the demo command."
cli bindings create --agent demo-agent --pool demo-pool --profile demo-command

say "starting a Runtime Host in pool demo-pool"
AGENTSCOPE_HOST_TOKEN="$HOST_TOKEN" AGENTSCOPE_POOL=demo-pool AGENTSCOPE_STATE_DIR="$RUN/host" \
    AGENTSCOPE_HEALTH_ADDR=127.0.0.1:0 AGENTSCOPE_NAME=demo-host start host "$BIN/svc-host"
wait_ok "the host's dispatch readiness" bash -c "'$BIN/agentscope' --json hosts list | python3 -c 'import json,sys; h=json.load(sys.stdin)[\"items\"]; sys.exit(0 if h and h[0][\"checks\"][\"dispatch_readiness\"][\"ok\"] else 1)'"
cli hosts list

say "a git repository with a feature branch"
REPO="$RUN/repo"
mkdir -p "$REPO"
git -C "$REPO" -c init.defaultBranch=main init -q
echo demo >"$REPO/README.md"
git -C "$REPO" add . && git -C "$REPO" -c user.name=demo -c user.email=demo@example.com commit -qm initial
git -C "$REPO" checkout -qb feature
echo "only on the feature branch" >"$REPO/FEATURE.txt"
git -C "$REPO" add . && git -C "$REPO" -c user.name=demo -c user.email=demo@example.com commit -qm "feature work"
git -C "$REPO" checkout -q main

say "an Issue assigned to demo-agent becomes a Task; following its events"
TASK=$(cli --json issues create "Make the demo pass" --body "Show the whole path." --assign demo-agent \
    --repo "$REPO" --branch feature | json "['task_id']")
cli runtime logs -f "$TASK"
say "the task"
cli tasks show "$TASK"
if [ "$KEEP" = 1 ]; then
    say "the system keeps running: AGENTSCOPE_API=$AGENTSCOPE_API AGENTSCOPE_TOKEN=$AGENTSCOPE_TOKEN; logs in $RUN; stop with scripts/demo.sh --stop"
fi

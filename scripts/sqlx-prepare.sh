#!/usr/bin/env bash
# Regenerates the offline query data (<crate>/.sqlx/query-*.json) that sqlx's query! macros check
# against when building without a database (SQLX_OFFLINE=true, .cargo/config.toml). Run it after
# changing a checked query or a migration, and commit what it writes.
#
#   scripts/sqlx-prepare.sh                 # every crate that has a .sqlx directory
#   scripts/sqlx-prepare.sh svc-gateway     # one crate (by its directory)
#
# It migrates a scratch database (PostgreSQL at $AGENTSCOPE_PREPARE_PG, default the machine's
# 127.0.0.1:5432 with trust auth) with shared/store/migrations, then checks each crate online with
# SQLX_OFFLINE_DIR pointing at its .sqlx, which makes the macros write one file per query.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${AGENTSCOPE_PREPARE_PG:-postgres://postgres@127.0.0.1:5432}"
db="agentscope_sqlx_prepare_$$"
psql "$base/postgres" -qAt -c "CREATE DATABASE $db" >/dev/null
new=""
cleanup() {
    if [ -n "$new" ]; then rm -rf "$new"; fi
    psql "$base/postgres" -qAt -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null
}
trap cleanup EXIT
for f in shared/store/migrations/*.sql; do
    psql "$base/$db" -q -v ON_ERROR_STOP=1 -f "$f" >/dev/null
done
if [ "$#" -gt 0 ]; then
    dirs=("$@")
else
    mapfile -t dirs < <(find . -name .sqlx -type d -not -path './target/*' -printf '%h\n' | sed 's|^\./||' | sort)
fi
for dir in "${dirs[@]}"; do
    dir="${dir%/}"
    [ -f "$dir/Cargo.toml" ] || { echo "sqlx-prepare: $dir is not a crate directory" >&2; exit 2; }
    name="$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$dir/Cargo.toml" | head -1)"
    # Written next to the old data and swapped in only when the check passes, so a query that
    # does not check leaves the committed data as it was; stale files go with the old directory.
    new="$dir/.sqlx.new"
    rm -rf "$new"
    mkdir -p "$new"
    # Dependencies first, offline: every crate compiled during the online check writes its
    # queries into SQLX_OFFLINE_DIR, so only this one may compile then. (A failure here is this
    # crate's own changed queries, which the online check is for.)
    cargo check --quiet --locked -p "$name" --all-targets >/dev/null 2>&1 || true
    # The macros run again only when the crate recompiles.
    for sub in src tests benches examples; do
        if [ -d "$dir/$sub" ]; then find "$dir/$sub" -name '*.rs' -exec touch {} +; fi
    done
    echo "sqlx-prepare: $name ($dir/.sqlx)"
    if ! SQLX_OFFLINE=false DATABASE_URL="$base/$db" SQLX_OFFLINE_DIR="$PWD/$new" \
        cargo check --quiet --locked -p "$name" --all-targets; then
        echo "sqlx-prepare: $name does not check; $dir/.sqlx left as it was" >&2
        exit 1
    fi
    rm -rf "$dir/.sqlx"
    mv "$new" "$dir/.sqlx"
    echo "sqlx-prepare: $(find "$dir/.sqlx" -name 'query-*.json' | wc -l) queries in $dir/.sqlx"
done

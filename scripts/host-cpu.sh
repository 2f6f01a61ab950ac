#!/usr/bin/env bash
# The host's CPU per attempt: runs agentscope-bench with one host, once with LOW and once with
# HIGH no-op tasks, samples the host's /proc/<pid>/stat (utime+stime+cutime+cstime: children
# included, i.e. its sentinels and the providers themselves) until it exits, and prints the
# difference per attempt. CPU time, not wall-clock: robust to the machine being busy.
#
#   AGENTSCOPE_BIN_DIR=$CARGO_TARGET_DIR/release scripts/host-cpu.sh [LOW HIGH CAPACITY]
set -euo pipefail
BIN=${AGENTSCOPE_BIN_DIR:?set AGENTSCOPE_BIN_DIR to the directory of release binaries}
LOW=${1:-20}
HIGH=${2:-320}
CAPACITY=${3:-8}
TCK=$(getconf CLK_TCK)

host_ticks() { # tasks -> the host's user and system CPU ticks at its end
    local tasks=$1 last="" bench
    "$BIN/agentscope-bench" bulk --tasks "$tasks" --hosts 1 --capacity "$CAPACITY" >&2 &
    bench=$!
    while kill -0 "$bench" 2>/dev/null; do
        for p in $(pgrep -P "$bench" -x svc-host || true); do
            t=$(awk '{print $14+$16, $15+$17}' "/proc/$p/stat" 2>/dev/null || true)
            [ -n "$t" ] && last=$t
        done
        sleep 0.05
    done
    wait "$bench"
    echo "$last"
}

low=$(host_ticks "$LOW")
high=$(host_ticks "$HIGH")
awk -v l="$low" -v h="$high" -v n=$((HIGH - LOW)) -v tck="$TCK" 'BEGIN {
    split(l, a, " "); split(h, b, " ");
    printf "host CPU (user+system): %d tasks %.2f+%.2f s, %d tasks %.2f+%.2f s\n",
        '"$LOW"', a[1] / tck, a[2] / tck, '"$HIGH"', b[1] / tck, b[2] / tck;
    printf "per attempt: %.3f ms (user %.3f ms, system %.3f ms)\n",
        (b[1] + b[2] - a[1] - a[2]) / tck * 1000 / n, (b[1] - a[1]) / tck * 1000 / n,
        (b[2] - a[2]) / tck * 1000 / n }'

#!/usr/bin/env bash
# The README's first command: installs what Proxima needs, builds it, starts proximad on its
# built-in default config (no GPU needed) and runs a short workload through the client that
# shows puts, lookups, gets and the daemon's stats. Stops the daemon at the end.
# PROXIMA_DEMO_PREBUILT=DIR runs the binaries of an existing build directory instead (no install,
# no build), and PROXIMA_DEMO_RUNNER a command both run under (scripts/aarch64.sh: qemu).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${PROXIMA_DEMO_PREBUILT:-build}
if [ -z "${PROXIMA_DEMO_PREBUILT:-}" ]; then
  ./scripts/install-deps.sh
  PROXIMA_TARGETS="proximad proximactl" ./scripts/build.sh build
fi
RUN=(${PROXIMA_DEMO_RUNNER:-})

RUN_DIR=$(mktemp -d /tmp/proxima-demo-XXXXXX)
SOCK="$RUN_DIR/proximad.sock"
CTL="${RUN[*]} ./$BUILD/tools/proximactl/proximactl"
# The default config, with the socket moved into a scratch directory so the demo needs no
# /run/proxima and cannot clash with an installed daemon; TCP on port 0 for the same reason.
# A snapshot file there too: a restart after SIGTERM keeps the blocks (warm restart).
# Under an emulator (PROXIMA_DEMO_RUNNER) proximad cannot start itself again to check UCX worker
# addresses in a child process (the kernel does not know its binaries): that check is off there.
EMULATED=()
[ ${#RUN[@]} -gt 0 ] && EMULATED=(--set ucx.check_worker_addresses=false)
start_daemon() {
  rm -f "$RUN_DIR/ports.json"
  "${RUN[@]}" "./$BUILD/daemon/proximad" "${EMULATED[@]}" --set "server.unix_socket=$SOCK" \
    --set server.listen=127.0.0.1:0 --set server.metrics_listen=127.0.0.1:0 \
    --set "tiers.host.snapshot_file=$RUN_DIR/snapshot" --port_file="$RUN_DIR/ports.json" \
    2> "$RUN_DIR/proximad.log" &
  DAEMON=$!
  for _ in $(seq 100); do [ -s "$RUN_DIR/ports.json" ] && break; sleep 0.1; done
  [ -s "$RUN_DIR/ports.json" ] || { cat "$RUN_DIR/proximad.log"; exit 1; }
  METRICS_PORT=$(sed -E 's/.*"metrics_port":([0-9]+).*/\1/' "$RUN_DIR/ports.json")
}
start_daemon
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null; rm -rf "$RUN_DIR"' EXIT
T="--target=unix:$SOCK"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "proximad is running (pid $DAEMON); its start-up log:"
cat "$RUN_DIR/proximad.log"
step "proximactl info"
$CTL info $T
step "A worker stores the KV of a 12-block sequence (256 KiB blocks: 4 layers x 16 tokens x 8 heads x 128 dim, bf16)"
$CTL put $T --seed=7 --count=12
step "The scheduler asks how much of a 16-block prompt with that prefix is cached"
$CTL lookup $T --seed=7 --count=16
step "The worker loads the cached blocks (every byte is checked against what was stored)"
$CTL get $T --seed=7 --count=16
step "SIGTERM, then start again: the blocks were written to a snapshot and are read back (warm restart)"
kill -TERM $DAEMON
wait $DAEMON
grep -o 'wrote the blocks to the snapshot.*' "$RUN_DIR/proximad.log"
start_daemon
grep -o 'loaded the blocks of the snapshot.*' "$RUN_DIR/proximad.log"
$CTL get $T --seed=7 --count=12
step "Load: 4 clients, 3 seconds of mixed gets and puts"
$CTL load $T --clients=4 --duration=3
step "proximactl stats"
$CTL stats $T
step "A few of the Prometheus metrics (http://127.0.0.1:$METRICS_PORT/metrics)"
curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^proxima_(tier_(used|capacity)_bytes|get_hits_total|get_misses_total|blocks_put_total|requests_total\{method="Get")' || true
step "SIGTERM: proximad drains, writes its snapshot and exits"
kill -TERM $DAEMON
wait $DAEMON && echo "proximad exited 0"
tail -n 3 "$RUN_DIR/proximad.log"
trap 'rm -rf "$RUN_DIR"' EXIT
